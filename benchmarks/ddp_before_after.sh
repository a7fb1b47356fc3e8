#!/bin/bash
# Our trainer before and after a change, at both draft shapes, 1 and 2 GPUs, in ONE device call (nvidia-h200-x2):
# the "before" code is an export of an older commit, so both sides run in the same machine state.
#
#   here:    git archive <before-rev> backend profiles | (mkdir -p .device/base && tar -x -C .device/base)
#            git rev-parse <before-rev> > .device/base/COMMIT
#   device:  bash benchmarks/ddp_before_after.sh        (carry .device/whl and .device/base; results in $OUT)
#
# Per shape: the working tree on 1 GPU (the scaling baseline), the before-code on 2 GPUs, the working tree on 2 GPUs;
# then a summary: step time ratio, peak memory difference, and the largest difference of the first 50 losses.
# Used for gradient_as_bucket_view (benchmarks/results/h200x2_bucket_view_*.json).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
O=${OUT:-/tmp/out}; mkdir -p $O
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .device/whl/*.whl && export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,memory.used --format=csv | tee $O/log.txt
run() { local name=$1; shift; echo "=== $name: $*" | tee -a $O/log.txt; local t0=$(date +%s); timeout ${T:-170} "$@" > /tmp/$name.out 2>&1; echo "rc=$? wall=$(( $(date +%s) - t0 ))s" | tee -a $O/log.txt; grep -E "^ours|rank|scaling|Error|error" /tmp/$name.out | tail -8 | tee -a $O/log.txt; }
TR="python3 -m torch.distributed.run --standalone --nproc_per_node 2"
run new_llama_1 python3 benchmarks/bench_trainer.py --label after-1gpu --json $O/new_llama_1.json
run base_llama_2 $TR benchmarks/bench_trainer.py --code-root .device/base --label before-2gpu --baseline-json $O/new_llama_1.json --json $O/base_llama_2.json
run new_llama_2 $TR benchmarks/bench_trainer.py --label after-2gpu --baseline-json $O/new_llama_1.json --json $O/new_llama_2.json
run new_kimi_1 python3 benchmarks/bench_trainer.py --shape kimi --label after-1gpu --json $O/new_kimi_1.json
run base_kimi_2 $TR benchmarks/bench_trainer.py --shape kimi --code-root .device/base --label before-2gpu --baseline-json $O/new_kimi_1.json --json $O/base_kimi_2.json
run new_kimi_2 $TR benchmarks/bench_trainer.py --shape kimi --label after-2gpu --baseline-json $O/new_kimi_1.json --json $O/new_kimi_2.json
python3 - <<'PY' 2>&1 | tee -a $O/log.txt
import json, os
O = os.environ.get("OUT", "/tmp/out")
def load(n):
    p = f"{O}/{n}.json"
    return json.load(open(p)) if os.path.exists(p) else None
for shape in ("llama", "kimi"):
    b, n = load(f"base_{shape}_2"), load(f"new_{shape}_2")
    for name, r in (("before", b), ("after", n)):
        if r:
            print(f"{shape} {name} 2gpu: {r['median_step_ms']:.1f} ms, {r['tokens_per_s']:.0f} tok/s, peak alloc {r['peak_mem_allocated_gib']:.2f} GiB, reserved {r['peak_mem_reserved_gib']:.2f} GiB, scaling {(r.get('scaling') or {}).get('efficiency')}")
    if b and n:
        print(f"{shape}: after/before step {n['median_step_ms']/b['median_step_ms']:.3f}, peak alloc {n['peak_mem_allocated_gib']-b['peak_mem_allocated_gib']:+.2f} GiB, max |loss diff| first 50 {max(abs(x-y) for x,y in zip(b['losses_first_50'], n['losses_first_50'])):.2e}")
PY
