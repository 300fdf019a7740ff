"""Load imbalance: W real processes run a long-tailed minibatch stream with collectives or with ODC, with real
communication and modelled (slept) compute: no model is trained.

    python bench/imbalance.py --quick             # about a minute on 2 busy cores, outlier phase included: 4 ranks
    python bench/imbalance.py                     # fuller run
    torchrun --nproc-per-node 4 bench/imbalance.py --quick
    python bench/imbalance.py --preset swe_agentic --model 1.5b --json out.json --plot out.png
    python bench/imbalance.py --quick --hsdp 2x2     # HSDP: 2 replicas × shard groups of 2 ranks

``--quick`` then runs an outlier phase (on the host backend; ``--outliers`` on others, ``--no-outliers`` to skip it):
odc + lb_mini and odc + lb_mini_split on minibatches of 2 samples per rank (at the default seed those of the split
run below), where a single sample costs more than a rank's fair share, its compute fitted to 6 s; a second table
compares them and the plot adds their timelines, the gang's K/V exchange included.

Split plans (``--comms odc --policies lb_mini,lb_mini_split``, not in the default grid, whose rows stay the
whole-sample policies): ``lb_mini_split`` runs only when named in ``--policies`` or in the outlier phase, and only
with ODC (collectives cannot run a plan whose ranks run different micro-batches, let alone a gang). Its gang
micro-batches run on all their members, and every layer really exchanges the chunk's K/V (forward) and dK/dV
(backward) between them through :mod:`odc_runtime.gang` (volumes per token scaled like the parameters,
:func:`kv_features`), with each chunk's modelled compute from the split's cost model
(:func:`odc_runtime.split.chunk_cost`); the exchanged values are checked exactly. A few samples per rank is where
splitting pays:

    python bench/imbalance.py --nproc 4 --minibatch-size 8 --seed 2 --minibatches 6 --budget-s 20 \
        --comms odc --policies lb_mini,lb_mini_split

For each configuration of the grid {collective, odc} × {local_sort, verl_lb_micro, lb_micro, lb_mini} (lb_mini
only with odc: its ranks run different numbers of micro-batches, which collectives cannot do) the same
minibatches are planned (:func:`odc_runtime.balance.plan`), laid out as a schedule (:mod:`schedule`: a pure
function of the lengths, the policy and the cost model) and executed (:mod:`executor`): every layer of every micro-batch
really gathers its parameters and scatters its gradient between the processes (gloo collectives, or
``odc.fetch`` / ``odc.push`` on the host transport), while the compute of each layer is *modelled*: the
micro-batch's cost on the chosen GPU (``CostModel.from_model_config`` of ``--model`` at ``--mfu`` of the
``--gpu``'s bf16 peak), times ``--time-scale``, spent in ``time.sleep`` (``--compute busy`` for a busy-wait).
Configurations run interleaved minibatch by minibatch, so a slow phase of a shared machine hits all alike.

``--hsdp RxS`` (R replicas × S-rank shard groups, R·S ranks): parameters and gradients are sharded within each
shard group (gloo all-gather / reduce-scatter on the shard group, or ``odc.shard(..., group=)`` with fetch / push
inside it and one ``odc.sync(group=)`` per minibatch), and each minibatch ends with a real gloo ``all_reduce`` of
every rank's gradient shards across its replicate group, in both modes. The planner still balances over all R·S
ranks (the all-reduce waits for the slowest replica), and the gradient check runs after the all-reduce.

Reported per configuration: throughput (real tokens / wall seconds, at the scaled compute), device
utilisation (time in compute / (ranks × wall)), idle seconds per rank (wall − compute), speedup over each
collective baseline (local_sort; verl_lb_micro, veRL's dynamic batching, what a veRL user runs; lb_micro, the
best collective schedule), and what the simulator (:mod:`simulate`) predicts for the same schedule from the
compute alone (``sim``), which separates the effect of balancing from that of this machine's communication.

``--backend nvshmem`` runs the same job on GPUs: tensors on CUDA, ODC on the nvshmem transport, collectives on
NCCL (one rank per GPU) or on gloo when ranks share a GPU (``--pes-per-gpu K``: rank r on GPU r // K; NCCL refuses
two ranks on one GPU; several nvshmem PEs on one GPU need CUDA MPS, ``nvidia-cuda-mps-control -d``). The compute is
still modelled on the host; a rank waits for each gather and scatter to finish on the GPU (stream synchronised)
before it counts as done. Refused with a clear error where CUDA or the ``odc_runtime._C`` extension is missing.

    python bench/imbalance.py --quick --backend nvshmem --pes-per-gpu 4   # 4 ranks on one GPU (MPS running)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if not __package__:  # python bench/imbalance.py from a checkout (bench/_checkout.py)
    import _checkout  # noqa: F401

from odc_runtime import cli
from odc_runtime import transport as transports
from odc_runtime.bench import _common
from odc_runtime.bench._common import launch, progress
from odc_runtime.bench.schedule import (
    COMMS,
    GPU_PEAK_FLOPS,
    MODELS,
    POLICIES,
    SIMULATED_POLICIES,
    Schedule,
    build_schedule,
    grid,
)

Schedules = dict[tuple[str, str], Schedule]  # (comm, policy) → schedule

#: The collective configurations every run is compared with: the naive baseline, what a veRL user runs today
#: (dynamic batching, the paper's LB-Micro) and the best collective schedule this planner can make.
BASELINES = ("local_sort", "verl_lb_micro", "lb_micro")

# --quick picks the time scale that makes the whole grid's modelled compute last QUICK_BUDGET_S seconds,
# so that it takes under a minute (with start-up and planning: 45-50 s measured on 2 cores at load average 8-10)
# whatever the preset or model. Both runs execute 2 layers of 0.25 MiB: this CPU's gloo collectives (milliseconds
# each when loaded) then stay small next to the modelled compute, so the measured speedups track the compute-only
# prediction instead of rewarding ODC for gloo's cost (8 layers of 1 MiB at load average 9-12: ODC + lb_micro
# measured 1.29× collective + lb_micro where the schedule predicts 1.03×). The layer count does not change the
# balancing: each micro-batch's cost is split evenly over the layers, so every layer's barrier waits the same share.
QUICK = {"minibatches": 6, "minibatch_size": 32, "time_scale": None, "layers": 2, "layer_mb": 0.25, "budget_s": 25.0}
#: --quick's outlier phase: after the grid, odc + lb_mini and odc + lb_mini_split on minibatches of
#: OUTLIER_SAMPLES_PER_RANK samples per rank, where single samples cost more than a rank's fair share and splitting
#: pays. Its compute lasts OUTLIER_BUDGET_S (when the grid's time scale is fitted to a budget; else it runs at the
#: grid's scale): at the grid's scale its minibatches would be so short that the gang's per-layer exchange on a
#: loaded CPU would hide the balancing. With a preset its lengths are drawn with seed --seed + OUTLIER_SEED_OFFSET:
#: at the default seed, the minibatches of the measured split run in docs/balancing.md (--seed 2 --minibatches 6
#: --minibatch-size 8 on 4 ranks).
OUTLIER_SAMPLES_PER_RANK = 2
OUTLIER_MINIBATCHES = 6
OUTLIER_SEED_OFFSET = 2
OUTLIER_BUDGET_S = 6.0
OUTLIER_POLICIES = ("lb_mini", "lb_mini_split")
FULL = {"minibatches": 12, "minibatch_size": 64, "time_scale": 0.03, "layers": 2, "layer_mb": 0.25, "budget_s": None}


def parse_hsdp(text: str) -> tuple[int, int]:
    """``RxS`` → (replicas, shard size), both at least 1 (argparse ``type``)."""
    try:
        r, s = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--hsdp expects RxS (replicas x shard size, e.g. 2x2): {text!r}") from None
    if r < 1 or s < 1:
        raise argparse.ArgumentTypeError(f"--hsdp {text!r}: replicas and shard size must be at least 1")
    return r, s


def build_parser() -> argparse.ArgumentParser:
    p = cli.parser(__doc__)
    p.add_argument("--nproc", type=int, default=4, help="ranks to spawn (ignored under torchrun)")
    p.add_argument("--backend", choices=transports.names(), default="host",
                   help="ODC transport; its device is the job's: host = CPU tensors and gloo collectives, nvshmem "
                        "= CUDA tensors and NCCL (gloo with --pes-per-gpu > 1)")
    p.add_argument("--pes-per-gpu", type=int, default=1, metavar="K",
                   help="GPU backend: K ranks share each GPU (rank r on GPU r // K; CUDA MPS needed for K > 1)")
    p.add_argument("--quick", action="store_true",
                   help=f"short run (about a minute on 2 busy cores, the outlier phase included): {QUICK}")
    _common.add_workload_args(p)
    p.add_argument("--model", default="7b", choices=sorted(MODELS), help="model whose compute is modelled")
    p.add_argument("--gpu", default="h100", choices=sorted(GPU_PEAK_FLOPS))
    p.add_argument("--mfu", type=float, default=0.4, help="achieved fraction of the GPU's bf16 peak")
    p.add_argument("--time-scale", type=float, default=None,
                   help=f"modelled GPU seconds → executed seconds (default {FULL['time_scale']}; with "
                        "--quick or --budget-s: chosen to fit the budget)")
    p.add_argument("--budget-s", type=float, default=None,
                   help=f"choose the time scale so that the grid's modelled compute (slowest rank, all "
                        f"configurations) lasts this many seconds (--quick: {QUICK['budget_s']:g})")
    p.add_argument("--minibatches", type=int, default=None, help=f"default {FULL['minibatches']}")
    p.add_argument("--minibatch-size", type=int, default=None,
                   help=f"samples per minibatch, all ranks together (default {FULL['minibatch_size']})")
    p.add_argument("--max-tokens", type=int, default=65536,
                   help="token cap of a micro-batch (a longer sample is refused unless --allow-oversized)")
    p.add_argument("--layers", type=int, default=None,
                   help=f"executed layers (FSDP units); the model's cost is split evenly over them "
                        f"(default {FULL['layers']}; --layers 0 = the model's layer count)")
    p.add_argument("--layer-mb", type=float, default=None,
                   help=f"MiB of fp32 parameters per executed layer (default {FULL['layer_mb']:g}; --quick "
                        f"{QUICK['layer_mb']:g})")
    p.add_argument("--compute", choices=("sleep", "busy"), default="sleep")
    p.add_argument("--hsdp", type=parse_hsdp, default=None, metavar="RxS",
                   help="HSDP: R replicas × S-rank shard groups (R*S = ranks); shard within a group, all-reduce "
                        "the gradient shards across replicas once per minibatch (default: shard over every rank)")
    p.add_argument("--comms", default=",".join(COMMS), type=_common.comma_list(COMMS),
                   help="communication modes to compare")
    p.add_argument("--policies", default=",".join(POLICIES), type=_common.comma_list(SIMULATED_POLICIES),
                   help="balancing policies (odc_runtime.balance.POLICY_REGISTRY); a splitting policy "
                        "(lb_mini_split) runs only when named here, with odc only")
    p.add_argument("--outliers", action=argparse.BooleanOptionalAction, default=None,
                   help=f"also run odc + {' and odc + '.join(OUTLIER_POLICIES)} on minibatches of "
                        f"{OUTLIER_SAMPLES_PER_RANK} samples per rank, where outliers exist and the split runs "
                        "(default: with --quick on the host backend, unless --hsdp or without odc in --comms)")
    p.add_argument("--trace-dir", default=None, metavar="DIR",
                   help="write every configuration's minibatches as ODC traces (DIR/rank<r>.jsonl, one label per "
                        "configuration, the outlier phase left out): python -m odc_runtime.report DIR draws them")
    p.add_argument("--timeline-minibatch", type=int, default=None,
                   help="minibatch shown in the timeline plot (default: the one with the median imbalance)")
    _common.add_output_args(p, "imbalance")
    return p


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill defaults: an explicit --time-scale wins, then --budget-s, then --quick's budget, then FULL's scale."""
    defaults = QUICK if args.quick else FULL
    for key in ("minibatches", "minibatch_size", "layers", "layer_mb"):
        if getattr(args, key) is None:
            setattr(args, key, defaults[key])
    if args.time_scale is not None:
        args.budget_s = None
    elif args.budget_s is None:
        args.budget_s = defaults["budget_s"]
        args.time_scale = defaults["time_scale"]
    if args.layers == 0:
        args.layers = MODELS[args.model].num_layers
    if args.outliers is None:  # by default only where CI runs it: a failure there would cost the grid's report
        args.outliers = args.quick and args.hsdp is None and "odc" in args.comms and args.backend == "host"
    return args


def gpu_placement(local_rank: int, local_world: int, pes_per_gpu: int, cuda_devices: int) -> tuple[int, str]:
    """(GPU index, torch.distributed backend) of a rank of the GPU backend; ``ValueError`` saying what to change
    when the node's ranks do not fit its GPUs at ``pes_per_gpu`` per GPU. A pure function."""
    if pes_per_gpu < 1:
        raise ValueError(f"--pes-per-gpu must be at least 1, got {pes_per_gpu}")
    need = -(-local_world // pes_per_gpu)
    if need > cuda_devices:
        hint = (f"pass --pes-per-gpu {-(-local_world // max(cuda_devices, 1))} (ranks sharing a GPU need CUDA MPS)"
                if pes_per_gpu == 1 else "raise --pes-per-gpu or start fewer ranks")
        raise ValueError(f"{local_world} ranks at {pes_per_gpu} per GPU need {need} GPUs, {cuda_devices} visible: "
                         f"{hint}")
    return local_rank // pes_per_gpu, "nccl" if pes_per_gpu == 1 else "gloo"


def check_backend(args: argparse.Namespace, local_world: int) -> str | None:
    """Why ``args`` cannot run on this machine (None: it can): a GPU backend without CUDA, without the extension,
    or with more ranks than its GPUs hold."""
    spec = transports.get(args.backend)
    if spec.device_type != "cuda":
        return None if args.pes_per_gpu == 1 else f"--pes-per-gpu needs a GPU backend (--backend {args.backend})"
    import torch

    if not torch.cuda.is_available():
        return (f"--backend {args.backend} runs the job on CUDA GPUs, and none is visible here; run it on a GPU "
                "machine, or drop --backend (the host transport on the CPU)")
    if not spec.is_available():
        if args.backend != "nvshmem":
            return (f"--backend {args.backend} is not available here: it needs a CUDA torch with SymmetricMemory "
                    '(torch >= 2.9) and triton (pip install -e ".[triton]"), on the GPUs of one node')
        return (f"--backend {args.backend}: the odc_runtime._C extension does not load here; build it for this "
                'GPU: pip install -e ".[cu13]" (or ".[cu12]"), or .ci/build_ext.sh')
    try:
        gpu_placement(0, local_world, args.pes_per_gpu, torch.cuda.device_count())
    except ValueError as e:
        return str(e)
    return None


def init_ranks(args: argparse.Namespace) -> tuple[int, int, object]:
    """torch.distributed for the job's device: (rank, world, device)."""
    if transports.get(args.backend).device_type != "cuda":
        return _common.init_distributed("cpu")
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    gpu, backend = gpu_placement(local, local_world, args.pes_per_gpu, torch.cuda.device_count())
    device = torch.device("cuda", gpu)
    torch.cuda.set_device(device)
    torch.set_num_threads(1)
    if backend == "nccl":
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    else:  # NCCL refuses two ranks on one GPU
        dist.init_process_group("gloo", rank=rank, world_size=world)
    return rank, world, device


def make_schedules(args: argparse.Namespace, batches: list[list[int]], world: int) -> Schedules:
    spec = MODELS[args.model]
    cost = spec.cost_model(GPU_PEAK_FLOPS[args.gpu] * args.mfu)
    replicas = args.hsdp[0] if args.hsdp else 1
    return {
        (comm, policy): build_schedule(batches, world, comm=comm, policy=policy, cost=cost,
                                       max_tokens=args.max_tokens, num_layers=args.layers, replicas=replicas,
                                       allow_oversized=args.allow_oversized)
        for comm, policy in grid(args.comms, args.policies)
    }


def fit_time_scale(schedules: Schedules, budget_s: float) -> float:
    """Time scale at which the compute-only simulation of every configuration sums to ``budget_s``."""
    from odc_runtime.bench.simulate import LINKS, simulate

    total = sum(simulate(s, layer_bytes=0, link=LINKS["none"]).time_s for s in schedules.values())
    return budget_s / total if total > 0 else 1.0


def pick_timeline_minibatch(schedules: Schedules, base: tuple[str, str] = ("collective", "local_sort"),
                            best: tuple[str, str] = ("odc", "lb_mini")) -> int:
    """The minibatch whose ``base`` vs ``best`` compute-only gap is the median one."""
    from odc_runtime.bench.simulate import LINKS, simulate

    a, b = schedules.get(base), schedules.get(best)
    if a is None or b is None:
        return 0
    ta = simulate(a, layer_bytes=0, link=LINKS["none"]).minibatch_s
    tb = simulate(b, layer_bytes=0, link=LINKS["none"]).minibatch_s
    ratios = sorted((x / y if y else 1.0, k) for k, (x, y) in enumerate(zip(ta, tb, strict=True)))
    return ratios[len(ratios) // 2][1]


# --------------------------------------------------------------------------------------------------- worker


def hsdp_groups(hsdp: tuple[int, int] | None, rank: int, world: int) -> tuple[object, object, int]:
    """(shard group, replicate group, shard size) of this rank; (None, None, world) without HSDP.

    Shard group g is ranks ``g·S .. g·S+S-1``, replicate group i is ranks ``i, S+i, ...`` (a (replicate, shard)
    mesh). Every rank creates every group in the same order, as ``torch.distributed.new_group`` requires."""
    import torch.distributed as dist

    if hsdp is None:
        return None, None, world
    r, s = hsdp
    if r * s != world:
        raise SystemExit(f"--hsdp {r}x{s} needs {r * s} ranks, running {world} (set --nproc {r * s})")
    shard = replica = None
    for g in range(r):
        grp = dist.new_group(list(range(g * s, (g + 1) * s)))
        if rank // s == g:
            shard = grp
    for i in range(s):
        grp = dist.new_group(list(range(i, world, s)))
        if rank % s == i:
            replica = grp
    return shard, replica, s


def kv_features(args: argparse.Namespace, layer_numel: int) -> int:
    """fp32 elements of K (and of V) per token that a gang exchanges per executed layer: the model's K/V bytes
    per token scaled like its parameters (an executed layer holds ``layer_numel`` elements for the model's
    ``layer_params`` bf16 ones; the layer counts cancel), at least 1."""
    spec = MODELS[args.model]
    per_token = spec.kv_token_bytes() / (2 * spec.layer_params()) * layer_numel  # fp32 elements, K and V
    return max(1, round(per_token / 2))


def outlier_phase(args: argparse.Namespace, rank: int, world: int, comm: object, gang: object | None,
                  kv_feat: int) -> tuple[dict, object]:
    """``--outliers``: odc + each of :data:`OUTLIER_POLICIES` on minibatches of :data:`OUTLIER_SAMPLES_PER_RANK`
    samples per rank (lengths drawn with seed ``--seed + OUTLIER_SEED_OFFSET``), compute fitted to
    :data:`OUTLIER_BUDGET_S` (at the grid's time scale when that was given), on the grid's ODC tensors (``comm``)
    and gang exchange (``gang``; made here, with ``kv_feat`` features, when the grid had none).
    Collective: every rank calls it. Returns (what :func:`report` needs, the gang exchange to free)."""
    import torch.distributed as dist

    from odc_runtime.bench.executor import GangKV, expected_grad, run_minibatch

    size = OUTLIER_SAMPLES_PER_RANK * world
    phase = argparse.Namespace(**{**vars(args), "comms": ["odc"], "policies": list(OUTLIER_POLICIES),
                                  "seed": args.seed + OUTLIER_SEED_OFFSET})
    batches, source = _common.load_minibatches(phase, OUTLIER_MINIBATCHES, size)
    schedules = make_schedules(phase, batches, world)
    same_schedules(schedules, world)
    timeline_k = pick_timeline_minibatch(schedules, ("odc", "lb_mini"), ("odc", "lb_mini_split"))
    scale = fit_time_scale(schedules, OUTLIER_BUDGET_S) if args.budget_s is not None else args.time_scale
    if gang is None:
        gang = GangKV(args.layers, args.max_tokens, kv_feat)
        gang.warm_up()
    records: dict = {key: [] for key in schedules}
    steps = [(k, key) for k in range(len(batches)) for key in schedules]
    t_run = time.perf_counter()
    for k, key in progress(steps, enabled=rank == 0, desc=f"{OUTLIER_SAMPLES_PER_RANK} samples/rank"):
        sched = schedules[key]
        records[key].append(run_minibatch(comm, sched.program(k, rank), expected_grad=expected_grad(sched, k),
                                          time_scale=scale, compute=args.compute,
                                          record=k == timeline_k, gang=gang))
    run_s = time.perf_counter() - t_run
    gathered: list = [None] * world
    dist.all_gather_object(gathered, {key: [vars(r) for r in recs] for key, recs in records.items()})
    return {"schedules": schedules, "gathered": gathered, "timeline_k": timeline_k, "run_s": run_s,
            "source": source, "minibatch_size": size, "gang_bytes": gang.exchange.nbytes, "time_scale": scale}, gang


def same_schedules(schedules: Schedules, world: int) -> None:
    """Raise unless every rank built the same schedules (a pure function of the lengths: a difference means
    different lengths files or versions)."""
    import torch.distributed as dist

    digests: list = [None] * world
    dist.all_gather_object(digests, {k: s.digest() for k, s in schedules.items()})
    if any(d != digests[0] for d in digests):
        raise RuntimeError("ranks built different schedules (different lengths files or versions?)")


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    import odc_runtime as odc
    from odc_runtime import telemetry
    from odc_runtime.bench.executor import (
        CollectiveComm,
        GangKV,
        OdcComm,
        expected_grad,
        run_minibatch,
        trace_waits,
        warm_up,
    )

    rank, world, device = init_ranks(args)
    load_before = os.getloadavg()
    batches, source = _common.load_minibatches(args, args.minibatches, args.minibatch_size)
    schedules = make_schedules(args, batches, world)
    same_schedules(schedules, world)
    if args.budget_s is not None:
        args.time_scale = fit_time_scale(schedules, args.budget_s)  # same on every rank: a pure function
    timeline_k = args.timeline_minibatch if args.timeline_minibatch is not None else pick_timeline_minibatch(schedules)
    shard_group, replica_group, shard_size = hsdp_groups(args.hsdp, rank, world)
    groups = {"group": shard_group, "replica_group": replica_group}
    shard_numel = -(-int(args.layer_mb * 2**20 / 4) // shard_size)
    comms = {}
    if any(c == "collective" for c, _ in schedules):
        comms["collective"] = CollectiveComm(args.layers, shard_numel, shard_size, device, **groups)
    if any(c == "odc" for c, _ in schedules):
        odc.init(args.backend)
        comms["odc"] = OdcComm(args.layers, shard_numel, shard_size, device, **groups)
    gang = None
    kv_feat = kv_features(args, shard_numel * shard_size)
    if any(m.chunk is not None for s in schedules.values() for mb in s.minibatches for r in mb.ranks for m in r):
        gang = GangKV(args.layers, args.max_tokens, kv_feat)
    for comm in comms.values():
        warm_up(comm, args.layers, world)
    if gang is not None:
        gang.warm_up()
    records: dict = {key: [] for key in schedules}
    steps = [(k, key) for k in range(len(batches)) for key in schedules]
    trace = telemetry.TraceWriter(args.trace_dir, rank) if args.trace_dir else None
    shared = [telemetry.run_id()]
    dist.broadcast_object_list(shared, src=0)  # rank 0's: the report ties the ranks' lines of a run by it
    run_id, to_wall = shared[0], time.time() - time.perf_counter()
    t_run = time.perf_counter()
    for k, key in progress(steps, enabled=rank == 0, desc="minibatch × config"):
        sched = schedules[key]
        before = odc.stats() if trace and key[0] == "odc" else None
        rec = run_minibatch(comms[key[0]], sched.program(k, rank), expected_grad=expected_grad(sched, k),
                            time_scale=args.time_scale, compute=args.compute, record=k == timeline_k or bool(trace),
                            gang=gang if key[0] == "odc" else None)
        records[key].append(rec)
        if trace:  # the runtime's line format: busy = modelled compute, the rest waits (comm, then sync)
            figures = {n: v - before[n] for n, v in odc.stats().items() if n != "minibatches"} if before else {}
            trace.write(telemetry.make_record(
                rank=rank, world=world, minibatch=k, start=rec.start + to_wall, end=rec.end + to_wall,
                micro_batches=len(sched.minibatches[k].ranks[rank]), label=f"{key[0]} + {key[1]}", run=run_id,
                waits=[(t0 + to_wall, t1 + to_wall, kind) for t0, t1, kind in trace_waits(rec)], **figures))
    if trace:
        trace.close()
    run_s = time.perf_counter() - t_run
    gathered: list = [None] * world
    dist.all_gather_object(gathered, {key: [vars(r) for r in recs] for key, recs in records.items()})
    gang_bytes = gang.exchange.nbytes if gang is not None else 0
    outliers = None
    if args.outliers and "odc" in comms:
        outliers, gang = outlier_phase(args, rank, world, comms["odc"], gang, kv_feat)
    if rank == 0:
        report(args, schedules, gathered, world, source, timeline_k, run_s, load_before, gang_bytes, outliers)
    if gang is not None:
        gang.free()
    if "odc" in comms:
        comms["odc"].free()
        odc.finalize()
    dist.barrier()
    dist.destroy_process_group()
    every = [*gathered, *(outliers["gathered"] if outliers else ())]
    wrong = sorted({f"{c}/{p}" for g in every for (c, p), recs in g.items() if not all(r["grad_ok"] for r in recs)})
    if wrong:  # every rank has every rank's records: all fail together, after a clean teardown
        raise RuntimeError(f"wrong gradients (data lost or duplicated in transit) in {', '.join(wrong)}")


# --------------------------------------------------------------------------------------------------- report


def summarize(schedules: Schedules, gathered: list[dict], world: int, time_scale: float) -> list[dict]:
    from odc_runtime.bench.simulate import LINKS, simulate

    runs = []
    for key, sched in schedules.items():
        per_rank = [g[key] for g in gathered]  # per_rank[r][k]
        n = len(per_rank[0])
        walls = [max(per_rank[r][k]["end"] for r in range(world)) - min(per_rank[r][k]["start"] for r in range(world))
                 for k in range(n)]
        wall = sum(walls)
        busy = [sum(rec["busy_s"] for rec in recs) for recs in per_rank]
        comm = [sum(rec["comm_s"] for rec in recs) for recs in per_rank]
        sync = [sum(rec["sync_s"] for rec in recs) for recs in per_rank]
        sim = simulate(sched, layer_bytes=0, link=LINKS["none"], time_scale=time_scale)
        modelled = sum(sum(mb.cost_s for mb in mbs) for m in sched.minibatches for mbs in m.ranks) * time_scale
        runs.append({
            "comm": key[0], "policy": key[1],
            "tokens": sched.tokens, "wall_s": wall, "minibatch_wall_s": walls,
            "tokens_per_s": sched.tokens / wall,
            "utilization": sum(busy) / (world * wall),
            "busy_s_per_rank": busy, "idle_s_per_rank": [wall - b for b in busy],
            "comm_wait_s_per_rank": comm, "sync_s_per_rank": sync,
            "modelled_compute_s": modelled,
            "micro_batches_per_rank": [sum(len(m.ranks[r]) for m in sched.minibatches) for r in range(world)],
            "grad_check_ok": all(rec["grad_ok"] for recs in per_rank for rec in recs),
            "kv_exchange_calls": sum(rec["kv_calls"] for recs in per_rank for rec in recs),
            "kv_exchange_bytes": sum(rec["kv_bytes"] for recs in per_rank for rec in recs),
            "sim_compute_only_s": sim.time_s,
            "sim_utilization": sim.utilization,
        })
    by_key = {(r["comm"], r["policy"]): r for r in runs}
    base = by_key.get(("collective", "local_sort"))
    for r in runs:
        r["speedup"] = base["wall_s"] / r["wall_s"] if base else None
        r["sim_speedup"] = base["sim_compute_only_s"] / r["sim_compute_only_s"] if base else None
        for policy in BASELINES:
            ref = by_key.get(("collective", policy))
            r[f"speedup_vs_collective_{policy}"] = ref["wall_s"] / r["wall_s"] if ref else None
    return runs


LEGEND = {
    "comm": "collective = gloo (GPU backend: NCCL) all-gather / reduce-scatter per layer in lockstep; odc = "
            "odc.fetch / odc.push, one odc.sync per minibatch (--hsdp: both within the shard group, plus one "
            "all-reduce of the gradient shards across replicas per minibatch)",
    "policy": "balancing policy (odc_runtime.balance.POLICY_REGISTRY); every configuration plans the same samples",
    "tokens/s": "real tokens / wall seconds at the scaled compute",
    "util": "device utilisation: modelled compute time / (ranks × wall)",
    "idle s/rank": "wall − compute per rank, seconds (min-max over ranks)",
    "comm wait s": "mean seconds a rank was blocked on communication (inside a collective this includes "
                   "waiting for slower ranks)",
    "wall s": "sum over minibatches of first rank's start to last rank's end",
    "speedup": "wall time of collective + local_sort / this configuration's",
    "× verl": "wall time of collective + verl_lb_micro (veRL's dynamic batching, the paper's LB-Micro: what a "
              "veRL user runs) / this configuration's",
    "× lb_micro": "wall time of collective + lb_micro (the best collective schedule this planner makes) / this "
                  "configuration's",
    "sim speedup": "the same ratio predicted by bench/simulate.py from the schedule's compute alone (no "
                   "communication): the part of the speedup due to balancing",
    "sim util": "device utilisation the same compute-only simulation predicts for this plan: the balance alone, "
                "without communication or scheduling noise",
    "grads": "ok: every rank's gradient shard held exactly the expected sum after every minibatch (--hsdp: after "
             "the cross-replica all-reduce); split plans: and every gang K/V exchange delivered exactly",
}


# The outlier table's columns are the main table's, but for its two ratios: only those are explained under it.
OUTLIER_LEGEND = {
    **{k: LEGEND[k] for k in ("comm", "policy", "tokens/s", "util", "idle s/rank", "comm wait s", "wall s")},
    "× lb_mini": "wall time of odc + lb_mini on the same minibatches / this configuration's",
    "sim × lb_mini": "the same ratio predicted from the schedule's compute alone (bench/simulate.py)",
    "sim util": LEGEND["sim util"],
    "grads": LEGEND["grads"],
}
OUTLIER_NEW_COLUMNS = ("× lb_mini", "sim × lb_mini")
# A fresh-clone trial measured this spread (two consecutive runs): the phase's few long minibatches make it noisy.
OUTLIER_SPREAD = ("one run of this phase varies a lot on a shared machine (1.06× to 1.22× in two consecutive --quick "
                  "runs of a 2-core VM, predicted 1.28×): compare medians of several runs (--seed fixes the data, "
                  "not the timing)")


def _gang_notes(runs: list[dict], gang_bytes: int) -> None:
    by_key = {(r["comm"], r["policy"]): r for r in runs}
    for r in runs:
        if r["kv_exchange_calls"]:
            ref = by_key.get(("odc", "lb_mini"))
            gain = f"; {ref['wall_s'] / r['wall_s']:.3f}× odc + lb_mini's tokens/s in this run" if ref else ""
            print(f"  {r['comm']} + {r['policy']}: gang micro-batches ran their K/V exchange through odc_runtime.gang: "
                  f"{r['kv_exchange_calls']} layer exchanges, {r['kv_exchange_bytes'] / 2**20:.1f} MiB put (K/V "
                  f"scaled like the parameters), {gang_bytes / 2**20:.2f} MiB of symmetric memory per rank for the "
                  f"exchange{gain}; collectives cannot run split plans (ODC only)")


def report_outliers(args: argparse.Namespace, outliers: dict, world: int) -> list[dict]:
    """Print the outlier phase's table (rank 0) and return its runs."""
    runs = summarize(outliers["schedules"], outliers["gathered"], world, outliers["time_scale"])
    ref = next((r for r in runs if (r["comm"], r["policy"]) == ("odc", "lb_mini")), None)
    rows = []
    for r in runs:
        idle = r["idle_s_per_rank"]
        r["speedup_vs_odc_lb_mini"] = ref["wall_s"] / r["wall_s"] if ref else None
        r["sim_speedup_vs_odc_lb_mini"] = ref["sim_compute_only_s"] / r["sim_compute_only_s"] if ref else None
        rows.append([
            r["comm"], r["policy"], r["tokens_per_s"], f"{r['utilization']:.1%}", f"{min(idle):.2f}-{max(idle):.2f}",
            f"{statistics.mean(r['comm_wait_s_per_rank']):.2f}", r["wall_s"], _ratio(r["speedup_vs_odc_lb_mini"]),
            _ratio(r["sim_speedup_vs_odc_lb_mini"]), f"{r['sim_utilization']:.1%}",
            "ok" if r["grad_check_ok"] else "WRONG",
        ])
    n_mb = len(next(iter(outliers["schedules"].values())).minibatches)
    print(f"\nOutliers: {n_mb} minibatches × {outliers['minibatch_size']} samples ({OUTLIER_SAMPLES_PER_RANK} per "
          f"rank) from {outliers['source']}, ×{outliers['time_scale']:g} time scale: a sample costing more than a "
          "rank's share is split across a gang of ranks (lb_mini_split; ODC only)")
    print(_common.format_table(list(OUTLIER_LEGEND), rows))
    print("  columns as in the table above; and:")
    width = max(len(h) for h in OUTLIER_LEGEND)
    for h in OUTLIER_NEW_COLUMNS:
        print(f"  {h:<{width}}  {OUTLIER_LEGEND[h]}")
    _gang_notes(runs, outliers["gang_bytes"])
    print(f"  NOTE: {OUTLIER_SPREAD}")
    print(f"  executed in {outliers['run_s']:.1f} s")
    return runs


def _ratio(x: float | None) -> str:
    return f"{x:.3f}" if x else "-"


def report(args: argparse.Namespace, schedules: Schedules, gathered: list[dict], world: int,
           source: str, timeline_k: int, run_s: float, load_before: tuple[float, float, float],
           gang_bytes: int = 0, outliers: dict | None = None) -> None:
    """Print the table and notes, write the JSON and the plot (rank 0). ``gang_bytes``: the symmetric memory the
    gang exchange held per rank (0: no split plan ran); ``outliers``: what :func:`outlier_phase` returned."""
    runs = summarize(schedules, gathered, world, args.time_scale)
    spec = MODELS[args.model]
    n_mb = len(next(iter(schedules.values())).minibatches)
    hsdp = f" as HSDP {args.hsdp[0]}×{args.hsdp[1]} (replicas × shard group)" if args.hsdp else ""
    import torch.distributed as dist

    collective = dist.get_backend()  # gloo, or nccl for the GPU backend at one rank per GPU
    per_gpu = f", {args.pes_per_gpu} per GPU" if args.pes_per_gpu > 1 else ""
    print(
        f"\n{world} ranks{hsdp}{per_gpu} ({collective} collectives vs ODC {args.backend} transport), {n_mb} "
        f"minibatches × {args.minibatch_size} "
        f"samples from {source}; compute modelled for {spec.name} on {args.gpu.upper()} at MFU {args.mfu:g}, "
        f"×{args.time_scale:g} time scale, {args.compute}; {args.layers} layers × {args.layer_mb:g} MiB; "
        f"max {args.max_tokens} tokens per micro-batch"
    )
    print("  (MFU: model FLOPs utilisation, the share of the GPU's bf16 peak the modelled compute reaches; time "
          f"scale: each modelled GPU second is executed as {args.time_scale:g} s of {args.compute}, so the run "
          "fits the machine while compute and communication keep their proportions)")
    rows = []
    for r in runs:
        idle = r["idle_s_per_rank"]
        rows.append([
            r["comm"], r["policy"], r["tokens_per_s"], f"{r['utilization']:.1%}",
            f"{min(idle):.2f}-{max(idle):.2f}", f"{statistics.mean(r['comm_wait_s_per_rank']):.2f}",
            r["wall_s"], *(_ratio(r[k]) for k in ("speedup", "speedup_vs_collective_verl_lb_micro",
                                                   "speedup_vs_collective_lb_micro")),
            f"{r['sim_speedup']:.3f}" if r["sim_speedup"] else "-", f"{r['sim_utilization']:.1%}",
            "ok" if r["grad_check_ok"] else "WRONG",
        ])
    _common.print_table(list(LEGEND), rows, LEGEND)
    sched = next(iter(schedules.values()))
    note = _common.oversized_note(sched.oversized, n_mb * args.minibatch_size, args.max_tokens)
    if note:
        print(f"  NOTE: {note}")
    _gang_notes(runs, gang_bytes)
    load_after = os.getloadavg()
    print(f"  executed in {run_s:.1f} s; load average {load_before[0]:.1f} → {load_after[0]:.1f} on "
          f"{os.cpu_count()} cores")
    outlier_runs = report_outliers(args, outliers, world) if outliers else None
    config = {k: v for k, v in vars(args).items() if k not in ("json", "plot")}
    config.update(world_size=world, source=source, model_name=spec.name, timeline_minibatch=timeline_k,
                  flops_per_second=GPU_PEAK_FLOPS[args.gpu] * args.mfu, run_s=run_s,
                  load_average_before=load_before, load_average_after=load_after, oversized_samples=sched.oversized,
                  gang_symmetric_bytes=gang_bytes)
    payload = {"runs": runs, "config": config, "machine": _common.machine_info()}
    timelines = {
        f"{comm} + {policy}, minibatch {timeline_k}": [g[(comm, policy)][timeline_k]["events"] for g in gathered]
        for comm, policy in (*(("collective", p) for p in BASELINES), ("odc", "lb_mini"), ("odc", "lb_mini_split"))
        if (comm, policy) in schedules
    }
    if outliers:
        k = outliers["timeline_k"]
        payload["outliers"] = {"runs": outlier_runs, "minibatch_size": outliers["minibatch_size"],
                               "timeline_minibatch": k, "run_s": outliers["run_s"],
                               "time_scale": outliers["time_scale"],
                               "gang_symmetric_bytes": outliers["gang_bytes"]}
        for key in outliers["schedules"]:
            name = f"{key[0]} + {key[1]}, {OUTLIER_SAMPLES_PER_RANK}/rank, ×{outliers['time_scale']:.2g} time"
            timelines[f"{name}, minibatch {k}"] = [
                g[key][k]["events"] for g in outliers["gathered"]]
    title = f"{world} ranks, {source}, {spec.name} on {args.gpu.upper()} (×{args.time_scale:g} time)"
    if note:
        title += f"\n{note}"
    _common.write_outputs(
        args, "imbalance", payload,
        lambda plots, path: plots.plot_imbalance(runs, timelines, path, title=title),
    )


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = resolve(parser.parse_args(argv))
    batches, _ = _common.load_minibatches(args, args.minibatches, args.minibatch_size)
    _common.check_cap(args, (s for b in batches for s in b))
    if args.hsdp and not _common.under_torchrun() and args.hsdp[0] * args.hsdp[1] != args.nproc:
        parser.error(f"--hsdp {args.hsdp[0]}x{args.hsdp[1]} needs --nproc {args.hsdp[0] * args.hsdp[1]}, "
                     f"got {args.nproc}")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if _common.under_torchrun() else args.nproc
    problem = check_backend(args, local_world)
    if problem:
        parser.error(problem)
    launch(worker, args.nproc, args)


if __name__ == "__main__":
    sys.exit(main())
