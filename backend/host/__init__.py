"""What a host has: GPUs, their holders, processes, disks (standard library only; NVML when importable)."""
