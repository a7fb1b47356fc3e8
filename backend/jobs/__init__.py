"""Owned jobs: the registry at run_dir/jobs.db, the watcher every job runs under, the identity-checked stop (standard library only)."""
