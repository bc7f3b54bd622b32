"""Sandboxed tool processes: `pool.SandboxPool` (asyncio side) and `boot.py` (inside the sandbox)."""
