"""Recurrent token mixers (Gated DeltaNet, Mamba-2): their per-sequence state in slots
(state.py), the causal convolution they share (conv.py) and their scans."""
