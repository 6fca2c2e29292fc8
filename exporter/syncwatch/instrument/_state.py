"""Process-wide state shared by the API, the hooks and the zero-code patches."""

monitor = None   # the rank's Monitor once init() succeeded; None = everything is a no-op
in_ddp_hook = 0  # >0 while a DDP comm hook runs: its own collectives are not counted twice
