"""Scripts run under a peer engine's own interpreter (octavo never imports the peer)."""
