"""What the page map (/dashboard, /v1/kv_map) shows of the paging state: block states and the
contiguous layout of the same traffic."""
