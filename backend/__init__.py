"""Host side of eagle3-console: agent, GPU telemetry, owned jobs, training, serving, benchmarks.

Nothing here imports Textual or console/. The agent path (agent.py, protocol.py, gpu.py, jobs.py,
holders.py, metrics.py) needs only the standard library so it can run on any host Python >= 3.10.
"""
