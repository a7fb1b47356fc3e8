"""Host side of eagle3-console: agent, GPU telemetry, owned jobs, training, serving, benchmarks.

Nothing here imports Textual or console/. The top-level modules are the vocabulary both sides share; each folder
is one component. The agent path (agent/, host/, jobs/, metrics/, external/ and the top-level modules but
profiles.py) needs only the standard library, so it runs on any host Python >= 3.10; train/, serve/, bench/ and
chain/ run as owned jobs in their own processes. pyproject.toml's import-linter contracts state the rules.
"""
