"""The host command lines both sides build (training, multi-node torchrun, stop-and-bench chain, grokking run, the agent), their defaults, and profile facts.

One home: `eagle3-host` (backend/chain/cli.py) reads its argparse defaults and builds its argv here, and the
console imports this module (with backend/protocol.py and backend/layout.py, the only backend modules it may).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Sequence


CHAIN_PREFIX = "chain-"
# stop-and-bench's stages in order: the chain writes them (backend/chain/run.py), the console draws them
CHAIN_STAGES = ("stop", "release", "checkpoint", "preflight", "launch", "canary", "bench", "result")
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
CHAIN_GRACE_DEFAULT_S = 120.0  # `stop-and-bench --grace` default
CHAIN_CONCURRENCY_DEFAULT = "1,4"
CHAIN_PROMPTS_DEFAULT = 8
CHAIN_MAX_NEW_TOKENS_DEFAULT = 64
GROK_WEIGHT_DECAY_DEFAULT = 0.1
# the chain result's acceptance["break"]["kind"]: a position breaks away, or every position is short by a like
# fraction (backend/serve/acceptance.py decides; the console words and colours them)
ACCEPTANCE_BREAK = "break"
ACCEPTANCE_SHORTFALL = "shortfall"

# NVLink multicast stays off for every distributed job (the device notes: NVLS/multicast hangs or fails on the
# shared H200 hosts); the trainer sets them before init_process_group too, so a bare torchrun keeps them.
NVLINK_MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# The most a stop waits between SIGTERM and SIGKILL (the agent's stop_job and `eagle3-host job stop --grace`), and
# the bound on its other waits. An hour: ample for a trainer to write its checkpoint, while a stop that holds a job's
# lock for a day (the jobs side once allowed 86400 s) would only hide a mistyped grace.
STOP_GRACE_MAX_S = 3600.0
# torchrun SIGKILLs its workers this long after forwarding a SIGTERM (its default, 30 s, can cut rank 0's
# checkpoint short); the stop's own grace (<= STOP_GRACE_MAX_S) is what bounds a stop. Read by torch >= 2.11's launcher.
TORCHRUN_SHUTDOWN_TIMEOUT_S = int(STOP_GRACE_MAX_S)
NODE_ENV = {**NVLINK_MULTICAST_OFF, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(TORCHRUN_SHUTDOWN_TIMEOUT_S)}
NODE_KEYS = ("run_id", "node_rank", "nnodes", "rdzv_endpoint")
NNODES_MAX = 1024
RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
HOST_PATTERN = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.-]{0,252})$")


def is_acceptance_shortfall(first_break: Any) -> bool:
    """Whether an acceptance report's `break` is a shortfall (every position short by a like fraction), not a break."""
    return isinstance(first_break, dict) and first_break.get("kind") == ACCEPTANCE_SHORTFALL


def option_value(argv: list[str], option: str) -> str | None:
    """The value of `--option VALUE` or `--option=VALUE` in a command line (the last one wins)."""
    found = None
    for index, arg in enumerate(argv):
        if arg == option and index + 1 < len(argv):
            found = argv[index + 1]
        elif arg.startswith(option + "="):
            found = arg.split("=", 1)[1]
    return found


def train_argv(profile: str, extra: Sequence[str] = ()) -> list[str]:
    """`eagle3-host train --profile P [extra...]`: what the console's `n` key starts."""
    return ["eagle3-host", "train", "--profile", profile, *extra]


def check_node(node: Any) -> dict[str, Any]:
    """A start_job `node` object, checked: {"run_id", "node_rank", "nnodes", "rdzv_endpoint"}; ValueError names the bad field."""
    if not isinstance(node, dict):
        raise ValueError(f"node: expected an object with {', '.join(NODE_KEYS)}, got {type(node).__name__}")
    unknown = sorted(set(node) - set(NODE_KEYS))
    if unknown:
        raise ValueError(f"node: unknown field(s) {', '.join(unknown)}; expected {', '.join(NODE_KEYS)}")
    run_id, node_rank, nnodes, endpoint = (node.get(key) for key in NODE_KEYS)
    if not isinstance(run_id, str) or not RUN_ID_PATTERN.match(run_id):
        raise ValueError(f"node.run_id: {run_id!r} is not a run id (letters, digits, '.', '_', '-'; at most 64)")
    if isinstance(nnodes, bool) or not isinstance(nnodes, int) or not 1 <= nnodes <= NNODES_MAX:
        raise ValueError(f"node.nnodes: {nnodes!r} is not a node count in 1..{NNODES_MAX}")
    if isinstance(node_rank, bool) or not isinstance(node_rank, int) or not 0 <= node_rank < nnodes:
        raise ValueError(f"node.node_rank: {node_rank!r} is not in 0..{nnodes - 1} (nnodes {nnodes})")
    parse_endpoint(endpoint)
    return {"run_id": run_id, "node_rank": node_rank, "nnodes": nnodes, "rdzv_endpoint": endpoint}


def parse_endpoint(endpoint: Any) -> tuple[str, int]:
    """HOST:PORT (an IPv6 host in brackets) -> (host, port); ValueError naming node.rdzv_endpoint otherwise."""
    host, _, port = endpoint.rpartition(":") if isinstance(endpoint, str) else ("", "", "")
    if not host or not HOST_PATTERN.match(host) or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"node.rdzv_endpoint: {endpoint!r} is not HOST:PORT (a host name or address of the first node, a port 1..65535)")
    return host, int(port)


def node_spec(run_id: str, node_rank: int, nnodes: int, rdzv_endpoint: str) -> dict[str, Any]:
    """The `node` object for start_job on one host of a multi-node run (checked)."""
    return check_node({"run_id": run_id, "node_rank": node_rank, "nnodes": nnodes, "rdzv_endpoint": rdzv_endpoint})


def torchrun_train_argv(train: Sequence[str], *, run_id: str, node_rank: int, nnodes: int, rdzv_endpoint: str, nproc_per_node: int | str = 1) -> list[str]:
    """Node `node_rank` of `nnodes` running an `eagle3-host train ...` command line under torchrun.

    The same train arguments run on every node. Static rendezvous on the first node's endpoint (node 0's torchrun
    hosts the TCP store): global ranks are node_rank * nproc_per_node + local rank, so rank 0, the only rank that
    writes metrics and checkpoints, is on node 0. (torch's c10d backend ignores --node-rank and orders nodes by
    host name and pid, which would put the checkpoint on any node.) --max-restarts 0: a failed rank ends the run;
    the other nodes' ranks then fail in their next collective and their torchruns exit too. A leading "python"
    is the agent's own interpreter (backend.jobs.registry.resolve_argv), as "eagle3-host" is.
    """
    train = list(train)
    if train[:2] != ["eagle3-host", "train"]:
        raise ValueError(f"train: expected an `eagle3-host train ...` command line, got {' '.join(train[:3])!r}")
    node = node_spec(run_id, node_rank, nnodes, rdzv_endpoint)
    if not (isinstance(nproc_per_node, int) and not isinstance(nproc_per_node, bool) and nproc_per_node >= 1) and nproc_per_node not in ("gpu", "cpu", "auto"):
        raise ValueError(f"nproc_per_node: {nproc_per_node!r} is not a positive count or one of gpu, cpu, auto")
    return [
        "python",
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(node["nnodes"]),
        "--node-rank",
        str(node["node_rank"]),
        "--nproc-per-node",
        str(nproc_per_node),
        "--rdzv-backend",
        "static",
        "--rdzv-endpoint",
        node["rdzv_endpoint"],
        "--rdzv-id",
        node["run_id"],
        "--max-restarts",
        "0",
        "-m",
        "backend",
        *train[1:],
    ]


def node_argv_conflicts(argv: Sequence[str], node: dict[str, Any]) -> list[str]:
    """Where a torchrun command line disagrees with its `node` object (empty when it agrees or names none of them)."""
    flags = {
        "--nnodes": node["nnodes"],
        "--node-rank": node["node_rank"],
        "--node_rank": node["node_rank"],
        "--rdzv-endpoint": node["rdzv_endpoint"],
        "--rdzv_endpoint": node["rdzv_endpoint"],
        "--rdzv-id": node["run_id"],
        "--rdzv_id": node["run_id"],
    }
    head = list(argv)[: list(argv).index("-m", 3)] if "-m" in list(argv)[3:] else list(argv)  # torchrun's own flags only
    return [
        f"{flag} {value} vs node {expected}" for flag, expected in flags.items() if (value := option_value(head, flag)) is not None and value != str(expected)
    ]


def data_dir_for(profile_data_dir: str, profile_run_dir: str, run_dir: str | Path | None) -> str:
    """The data dir a run uses: the profile's, moved with the run dir when it sits under the profile's run dir.

    tiny/llama: data_dir ~/.eagle3/data under run_dir ~/.eagle3, so --run-dir /scratch/e3 gives /scratch/e3/data;
    a data dir elsewhere (kimi: /data/eagle3) is explicit and kept.
    """
    if run_dir is None:
        return profile_data_dir
    data, home = _absolute(profile_data_dir), _absolute(profile_run_dir)
    if data != home and home not in data.parents:
        return profile_data_dir
    moved = _absolute(run_dir) / data.relative_to(home)
    return str(moved)


def _absolute(path: str | Path) -> Path:
    expanded = Path(path).expanduser()
    return Path(str(expanded.absolute()).rstrip("/") or "/")


def agent_args(run_dir: str, data_dirs: Sequence[str] = ()) -> list[str]:
    """The agent's arguments after the interpreter: -m backend.agent --run-dir D [--data-dir X ...]."""
    argv = ["-m", "backend.agent", "--run-dir", str(run_dir)]
    for data_dir in data_dirs:
        argv += ["--data-dir", str(data_dir)]
    return argv


def chain_job_name(train_job: str) -> str:
    return f"{CHAIN_PREFIX}{train_job}"


def chain_argv(train_job: str, extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """`eagle3-host stop-and-bench --job JOB --json [extra...]`: the chain the `b` key runs."""
    return ["eagle3-host", "stop-and-bench", "--job", train_job, "--json", *extra]


def chain_training_job(argv: list[str], chain_name: str) -> str:
    """Which training job a chain job works on: its --job, else its name without the prefix."""
    return option_value(argv, "--job") or chain_name.removeprefix(CHAIN_PREFIX)


def grok_argv(profile: str, checkpoint: str, lr: float, weight_decay: float, grokfast_alpha: float | None, max_steps: int | None = None) -> list[str]:
    """Resume CKPT with a constant LR as a new training job: what `eagle3-host grok` and the `g` key start."""
    argv = [
        "eagle3-host",
        "train",
        "--profile",
        profile,
        "--resume",
        str(PurePosixPath(checkpoint)),
        "--schedule",
        "constant",
        "--lr",
        repr(lr),
        "--weight-decay",
        repr(weight_decay),
    ]
    if grokfast_alpha is not None:
        argv += ["--grokfast-alpha", repr(grokfast_alpha)]
    if max_steps is not None:
        argv += ["--max-steps", str(max_steps)]
    return argv


def resume_argv(profile: str, checkpoint: str) -> list[str]:
    """Resume CKPT as a new training job with the profile's own schedule: what the console's resume key starts."""
    return ["eagle3-host", "train", "--profile", profile, "--resume", str(PurePosixPath(checkpoint))]


def resume_job_name(checkpoint: str) -> str:
    """resume-<checkpoint dir name>, e.g. resume-epoch-0-step-300."""
    return f"resume-{PurePosixPath(checkpoint).name}".replace("_", "-")


def grok_job_name(checkpoint: str) -> str:
    """grok-<checkpoint dir name>, as `eagle3-host grok` names it."""
    return f"grok-{PurePosixPath(checkpoint).name}".replace("_", "-")


@dataclass
class ProfileFacts:
    """What the console reads from a profile for its plans; `error` says why a profile could not be read here."""

    name: str
    engine: str | None = None
    port: int | None = None
    data_dir: str | None = None
    learning_rate: float | None = None
    weight_decay: float | None = None
    shape: dict[str, int] | None = None
    error: str | None = None


def profile_facts(name: str, run_dir: str | None = None) -> ProfileFacts:
    """The profile's facts; its data dir moved with `run_dir` (data_dir_for) when one is given."""
    from backend.profiles import ProfileError, load_profile  # pydantic: only when a profile is read

    try:
        profile = load_profile(name)
    except (ProfileError, OSError, ValueError) as exc:
        return ProfileFacts(name=name, error=str(exc).splitlines()[0][:200])
    return ProfileFacts(
        name=profile.name,
        engine=profile.serve.engine,
        port=profile.serve.port,
        data_dir=data_dir_for(profile.paths.data_dir, profile.paths.run_dir, run_dir),
        learning_rate=profile.train.learning_rate,
        weight_decay=profile.train.weight_decay,
        shape=profile_shape(profile),
    )


def profile_shape(profile: Any) -> dict[str, int]:
    """What one offline sample holds per token for a profile: aux features, teacher, dtype, sequence length."""
    target = profile.target
    return {
        "aux_width": len(target.aux_layer_ids) * target.hidden_size,
        # small vocabularies store teacher logits; large ones the final hidden state (lm_head applied at train time)
        "teacher_width": target.vocab_size if target.vocab_size <= 4096 else target.hidden_size,
        "dtype_bytes": DTYPE_BYTES.get(target.dtype, 2),
        "seq_len": profile.train.seq_len,
    }


def job_profile(argv: list[str], default: str) -> str:
    """The --profile of a recorded command line, else the console's profile."""
    return option_value(argv, "--profile") or default
