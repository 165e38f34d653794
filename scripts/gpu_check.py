"""The GPU path, checked in one command on a CUDA machine; results go to a folder.

    PYTHONPATH=. python scripts/gpu_check.py OUTDIR        # from the repository root
    PYTHONPATH=. python scripts/gpu_check.py OUTDIR --parts tests,bench --workers 12 --limits tests=300

Needs the project's own dependencies at the versions it pins (its test
helpers import the CLI: jsonargparse, and the timm the switch was written
against) plus whatever torch (>= 2.6), triton and pytest the machine has; a
part whose packages are missing is skipped and the summary says which and why.
``--workers N`` runs the tests part under pytest-xdist (the cold Triton
compiles spread over the cores); ``--limits`` shortens the parts' time limits
to fit a lease. The report is written after every part, so a run stopped from
outside keeps the parts that finished. Parts, each in a subprocess with
its own time limit (a part that hangs or crashes does not take the others
along):

1. ``tests``: ``pytest -m cuda tests/attention/kernels/test_triton_cuda.py``: the Triton
   kernel compiled for this GPU against the reference, values and gradients,
   fp32/bf16/fp16, masks, Swin bias, ragged shapes, large ``|S|`` in fp16,
   dropout, B*H > 65535, torch.compile.
2. ``bench``: ``python -m polyattn_lightning.bench attention --device cuda
   --dtype bfloat16`` at N = 197, 1024, 4096, 16384 (d = 64) against SDPA
   (FlashAttention for bf16 without a mask).
3. ``vit``: one ViT-S/16 training step (batch 64, 224 px, AdamW, bf16 autocast),
   softmax vs poly3, eager and under ``torch.compile``: median step time, peak
   memory, graph breaks.
4. ``timing``: what the offline compile (``bench triton-static``) cannot
   settle, poly3 forward+backward at 8 x 6 x 4096 x 64 (``TIMING_SHAPE``):
   bf16 vs fp16 (products on TF32, and on IEEE fp32 as the legacy table had
   them); fp32 at ``'highest'`` (IEEE) in Triton and in the blocked kernel vs
   ``'high'`` (tf32x3) vs ``'medium'`` (tf32); dropout 0 vs 0.1, one dropout
   call under ``torch.cuda.set_sync_debug_mode("warn")`` (a host sync warns);
   the legacy launch table and grid order vs the new (``POLYATTN_TRITON_TABLE``,
   ``POLYATTN_TRITON_GRID``). The Triton self-check is off here
   (``POLYATTN_TRITON_SELFCHECK=0``): the ``tests`` part checks the values.

5. ``decoder``: the sharding issue's GPU goal: a full fine-tune of a TinyLlama-1.1B-shaped decoder (random init,
   vocabulary 32000, batch 4 x 1024 tokens) on this one GPU through the project's sharding path (built on the meta
   device, ``fully_shard`` per decoder layer over a 1-GPU mesh, HF's own init once sharded, fp32 master shards with
   bf16 compute, AdamW), x^3 (``poly3``) against softmax (SDPA), steps interleaved: median step time (target
   poly3 <= 1.11x softmax), peak memory, the loss of both. At most 5 minutes (``LIMITS``).

Cold compiles: some 150 Triton compiles of 0.5-6 s each happen on first use, so
each part's limit (``LIMITS``) leaves room for them; every timed case runs once
untimed first (the warm-up that compiles it).

Writes ``OUTDIR/gpu_check.json`` (machine, versions, every part's status and
numbers), ``OUTDIR/summary.txt`` (short text), ``OUTDIR/bench.json``,
``OUTDIR/tests.log``, ``OUTDIR/vit.json``, ``OUTDIR/timing.json`` and ``OUTDIR/decoder.json``.
``--dry-run`` runs the timing cases and the decoder steps on CPU at tiny shapes
(no GPU needed; what the test suite checks).

Exit status: 0 every part that could run passed; 1 a part failed or timed out;
2 no CUDA GPU is visible (nothing was checked); 3 bad usage.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("tests", "bench", "vit", "timing", "decoder")
#: Seconds per part, cold Triton and inductor compiles included (they dominate: ~150 Triton compiles of
#: 0.5-6 s in the tests alone).
LIMITS = {"tests": 900, "bench": 300, "vit": 400, "timing": 600, "decoder": 300}
#: The decoder part's model (TinyLlama-1.1B's shape) and batch; the target of poly3's step time over softmax's.
DECODER = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False)
DECODER_BATCH, DECODER_TARGET = (4, 1024), 1.11
TIMING_SHAPE = (8, 6, 4096, 64)
BENCH_SHAPES = "32x6x197x64,8x6x1024x64,2x6x4096x64,1x6x16384x64"
NO_GPU = 2


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def unmet_pins() -> list[str]:
    """The project's dependencies (pyproject.toml; torch, torchvision and triton are the machine's) that this
    machine lacks or has at another version than the project admits: the parts that import the project fail
    on them."""
    import tomllib

    try:
        from packaging.requirements import Requirement
    except ImportError:
        return ["packaging missing: the project's pins were not checked"]

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    unmet = []
    for line in pyproject["project"]["dependencies"]:
        requirement = Requirement(line)
        if requirement.name in ("torch", "torchvision", "triton") or not requirement.specifier:
            continue
        found = _version(requirement.name)
        if found is None or not requirement.specifier.contains(found, prereleases=True):
            unmet.append(f"{requirement.name} {found or 'missing'} (the project admits {requirement.specifier})")
    return unmet


def _limits(text: str) -> dict[str, int]:
    """``--limits``: ``PART=SECONDS,...``, each part one of :data:`PARTS` and each limit above 0."""
    try:
        limits = {name: int(seconds) for name, seconds in (item.split("=") for item in text.split(",") if item)}
    except ValueError:
        limits = None
    if limits is None or not set(limits) <= set(PARTS) or min(limits.values(), default=1) <= 0:
        raise argparse.ArgumentTypeError(
            f"--limits {text!r}: expected PART=SECONDS,... with PART one of {PARTS} and SECONDS > 0"
        )
    return limits


def _workers(text: str) -> int:
    """``--workers``: 0 (one process), or more with pytest-xdist installed."""
    xdist = _version("pytest-xdist")
    if not text.isdigit() or (int(text) and xdist is None):
        raise argparse.ArgumentTypeError(
            f"--workers {text}: expected 0 (one process) or more workers with pytest-xdist installed "
            f"(pytest-xdist: {xdist or 'missing'})"
        )
    return int(text)


def environment() -> dict:
    import torch

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": _version("triton"),
        "timm": _version("timm"),
        "pytest": _version("pytest"),
        "xdist": _version("pytest-xdist"),
        "cuda_available": torch.cuda.is_available(),
        "cpu_count": os.cpu_count(),
        "unmet_pins": unmet_pins(),
    }
    if env["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, capability=f"{props.major}.{props.minor}", gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   gpu_count=torch.cuda.device_count())
        if shutil.which("nvidia-smi"):
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True)
            env["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout.strip() else None
    return env


def _run(command: list[str], limit: int, log: Path | None = None) -> dict:
    """Run a part's subprocess from the repository root with the source on PYTHONPATH."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    try:
        result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
        output, code = result.stdout + result.stderr, result.returncode
    except subprocess.TimeoutExpired as error:
        output = (error.stdout or b"").decode(errors="replace") + (error.stderr or b"").decode(errors="replace")
        code = None
    if log is not None:
        log.write_text(output)
    status = "timeout" if code is None else "passed" if code == 0 else "failed"
    return {"status": status, "exit_code": code, "seconds": round(time.perf_counter() - start, 1),
            "command": " ".join(command), "output_tail": output[-1500:]}


def part_tests(env: dict, out: Path, workers: int = 0) -> dict:
    missing = [name for name in ("pytest", "triton") if env[name] is None]
    if missing:
        return {"status": "skipped", "reason": f"{' and '.join(missing)} not installed"}
    spread = ["-n", str(workers)] if workers else []  # the cold Triton compiles spread over the CPU cores
    result = _run([sys.executable, "-m", "pytest", "-m", "cuda", "-p", "no:cacheprovider", "-q", "-rfEs", *spread,
                   "tests/attention/kernels/test_triton_cuda.py"], LIMITS["tests"], out / "tests.log")
    log = (out / "tests.log").read_text()  # the whole output: xdist workers' warnings follow pytest's summary
    summary = [line for line in log.splitlines() if re.search(r"\d+ (passed|failed|skipped|errors?)\b", line)]
    result["pytest"] = summary[-1] if summary else None
    # a CUDA test that skips on a GPU hides something, except one that needs more GPUs than the machine has
    skips = re.findall(r"^SKIPPED \[\d+\] \S+: (.*)$", log, re.MULTILINE)
    result["unexpected_skips"] = [reason for reason in skips if not reason.startswith("needs two CUDA GPUs")]
    if result["status"] == "passed" and (result["pytest"] is None or result["unexpected_skips"]):
        result["status"] = "failed"
    return result


def part_bench(env: dict, out: Path) -> dict:
    if env["triton"] is None:
        return {"status": "skipped", "reason": "triton not installed: the Triton kernel is what this measures"}
    result = _run([sys.executable, "-m", "polyattn_lightning.bench", "attention", "--device", "cuda", "--dtype",
                   "bfloat16", "--shapes", BENCH_SHAPES, "--repeats", "5", "--json", str(out / "bench.json")],
                  LIMITS["bench"])
    if (out / "bench.json").exists():
        report = json.loads((out / "bench.json").read_text())
        result["ratios"] = {
            shape: {label: case["ratio"] for label, case in entry["cases"].items()}
            for shape, entry in report["results"].items()
        }
        result["sdpa_ms"] = {shape: {k: round(entry["cases"]["softmax/sdpa"][k] * 1e3, 3) for k in ("fwd_s", "fwd_bwd_s")}
                             for shape, entry in report["results"].items()}
        result["targets"] = report["targets"]
    return result


def part_vit(env: dict, out: Path) -> dict:
    if env["timm"] is None:
        return {"status": "skipped", "reason": "timm not installed"}
    result = _run([sys.executable, str(Path(__file__).resolve()), "--vit-step", str(out / "vit.json")], LIMITS["vit"])
    if (out / "vit.json").exists():
        result["runs"] = json.loads((out / "vit.json").read_text())
    return result


def vit_step(path: Path, device: str = "cuda", model_name: str = "vit_small_patch16_224", batch: int = 64,
             image: int = 224, steps: int = 10) -> None:
    """ViT-S/16 training steps, softmax vs poly3, eager then compiled; appends each run to ``path`` as it ends.

    ``device`` and the sizes are parameters only so that the step can be smoke-tested on CPU.
    """
    import timm
    import torch
    import torch._dynamo

    from polyattn_lightning.attention import set_attention

    runs = []
    compile_ok = _version("triton") is not None
    for compiled in (False, True):
        for activation in ("softmax", "poly3"):
            label = f"{activation}/{'compiled' if compiled else 'eager'}"
            if compiled and not compile_ok:
                runs.append({"run": label, "status": "skipped", "reason": "triton not installed (inductor needs it)"})
                continue
            torch.manual_seed(0)
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            model = timm.create_model(model_name, num_classes=1000, img_size=image).to(device)
            set_attention(model, activation)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            images = torch.randn(batch, 3, image, image, device=device)
            labels = torch.randint(0, 1000, (batch,), device=device)
            sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
            forward = torch.compile(model) if compiled else model

            def step():
                with torch.autocast(device, dtype=torch.bfloat16):
                    loss = torch.nn.functional.cross_entropy(forward(images), labels)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                return loss

            start = time.perf_counter()
            first_loss = float(step().detach())
            sync()
            first_s = time.perf_counter() - start
            step()
            sync()
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                loss = step()
                sync()
                times.append(time.perf_counter() - start)
            runs.append({
                "run": label, "status": "ran", "batch": batch, "median_step_ms": round(statistics.median(times) * 1e3, 2),
                "first_step_s": round(first_s, 1), "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None,
                "first_loss": round(first_loss, 4), "last_loss": round(float(loss.detach()), 4),
                "graph_breaks": sum(torch._dynamo.utils.counters["graph_break"].values()) if compiled else None,
            })
            path.write_text(json.dumps(runs, indent=1))
            del model, optimizer, forward
            if device == "cuda":
                torch.cuda.empty_cache()
    for run in runs:
        if run["status"] == "ran":
            base = next((r for r in runs if r["run"] == f"softmax/{run['run'].split('/')[1]}"), None)
            run["time_vs_softmax"] = round(run["median_step_ms"] / base["median_step_ms"], 3) if base else None
    path.write_text(json.dumps(runs, indent=1))


def part_timing(env: dict, out: Path) -> dict:
    if env["triton"] is None:
        return {"status": "skipped", "reason": "triton not installed: the Triton kernel is what this times"}
    result = _run([sys.executable, str(Path(__file__).resolve()), "--timing", str(out / "timing.json")],
                  LIMITS["timing"])
    if (out / "timing.json").exists():
        result["cases"] = json.loads((out / "timing.json").read_text())
    return result


def part_decoder(env: dict, out: Path) -> dict:
    result = _run([sys.executable, str(Path(__file__).resolve()), "--decoder-step", str(out / "decoder.json")],
                  LIMITS["decoder"])
    if (out / "decoder.json").exists():
        result["decoder"] = json.loads((out / "decoder.json").read_text())
        if result["status"] == "passed" and not result["decoder"].get("met"):
            result["status"] = "failed"  # the target missed
    return result


def decoder_steps(path: Path, device: str = "cuda", config: dict | None = None, batch: tuple[int, int] = DECODER_BATCH,
                  steps: int = 10) -> None:
    """Full fine-tuning steps of the decoder, softmax vs poly3, interleaved, through the sharding path on one device
    (``fully_shard`` per layer over a 1-rank mesh, meta-device build and HF's init, bf16 compute on fp32 master shards
    where the device has bf16); ``device``/``config``/``batch`` are parameters so that CPU can smoke-test it."""
    import socket

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from transformers import AutoConfig, AutoModelForCausalLM

    from polyattn_lightning.attention import set_attention
    from polyattn_lightning.bench.timing import interleaved
    from polyattn_lightning.sharding.init import hf_initializer, materialize
    from polyattn_lightning.sharding.plan import apply_plan, require_blocks

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    try:
        mesh = init_device_mesh(device, (1,))
        bf16 = device == "cuda" and torch.cuda.is_bf16_supported()
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                                      reduce_dtype=torch.float32 if bf16 else None)
        settings = {**DECODER, **(config or {})}
        hf_config = AutoConfig.for_model("llama", **settings, max_position_embeddings=batch[1])
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, settings["vocab_size"], batch, generator=g).to(device)
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        runs, losses = {}, {}
        for activation in ("softmax", "poly3"):
            torch.manual_seed(0)
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa")
            apply_plan(model, require_blocks(model), mesh, policy)
            materialize(model, torch.device(device), hf_initializer(model))
            set_attention(model, activation)
            model.train()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
            losses[activation] = []

            def step(_, model=model, optimizer=optimizer, activation=activation):
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                sync()
                losses[activation].append(round(float(loss.detach()), 6))

            runs[activation] = step
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = interleaved(runs, steps)
        medians = {name: statistics.median(t) for name, t in times.items()}
        ratio = medians["poly3"] / medians["softmax"]
        parameters = sum(p.numel() for p in model.parameters())
        report = {
            "device": device, "parameters": parameters, "batch": list(batch), "bf16_compute": bf16,
            "median_step_ms": {name: round(m * 1e3, 2) for name, m in medians.items()},
            "poly3_vs_softmax": round(ratio, 3), "target": DECODER_TARGET, "met": ratio <= DECODER_TARGET,
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None,
            "losses": losses,
        }
        path.write_text(json.dumps(report, indent=1))
    finally:
        dist.destroy_process_group()


#: ``label -> (dtype, kernel, float32 matmul precision, dropout_p, POLYATTN_TRITON_TABLE, POLYATTN_TRITON_GRID)``.
TIMING_CASES = {
    "bf16": ("bfloat16", "triton", "highest", 0.0, "tuned", "blocks"),
    "fp16 (TF32 products)": ("float16", "triton", "highest", 0.0, "tuned", "blocks"),
    "fp16 (IEEE products, legacy table)": ("float16", "triton", "highest", 0.0, "legacy", "blocks"),
    "fp32 highest (blocked kernel)": ("float32", "blocked", "highest", 0.0, "tuned", "blocks"),
    "fp32 highest (triton, ieee)": ("float32", "triton", "highest", 0.0, "tuned", "blocks"),
    "fp32 high (tf32x3)": ("float32", "triton", "high", 0.0, "tuned", "blocks"),
    "fp32 medium (tf32)": ("float32", "triton", "medium", 0.0, "tuned", "blocks"),
    "bf16 dropout 0.1": ("bfloat16", "triton", "highest", 0.1, "tuned", "blocks"),
    "bf16 legacy table, heads-first grid": ("bfloat16", "triton", "highest", 0.0, "legacy", "heads"),
    "bf16 new table, heads-first grid": ("bfloat16", "triton", "highest", 0.0, "tuned", "heads"),
}


def timing_cases(path: Path, device: str = "cuda", shape: tuple[int, int, int, int] = TIMING_SHAPE,
                 repeats: int = 10) -> None:
    """Median poly3 forward+backward of each ``TIMING_CASES`` entry (round-robin, after a compiling warm-up),
    and whether a dropout call synchronises the host; ``device``/``shape`` only so that CPU can smoke-test it."""
    import warnings

    import torch

    from polyattn_lightning.attention import attention
    from polyattn_lightning.bench.timing import interleaved

    os.environ["POLYATTN_TRITON_SELFCHECK"] = "0"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(shape, generator=g) for _ in range(3)]

    def case(label):
        dtype, kernel, precision, dropout_p, table, grid = TIMING_CASES[label]
        q, k, v = (x.to(device, getattr(torch, dtype)).requires_grad_() for x in base)
        if device != "cuda":
            kernel = "auto"  # the dry run: whatever runs on CPU

        def step(_):
            previous = torch.get_float32_matmul_precision()
            os.environ.update(POLYATTN_TRITON_TABLE=table, POLYATTN_TRITON_GRID=grid)
            torch.set_float32_matmul_precision(precision)
            try:
                attention(q, k, v, "poly3", dropout_p=dropout_p, kernel=kernel).float().sum().backward()
                sync()
            finally:
                torch.set_float32_matmul_precision(previous)
        return step

    times = interleaved({label: case(label) for label in TIMING_CASES}, repeats)
    base_ms = statistics.median(times["bf16"]) * 1e3
    results = {label: {"median_ms": round(statistics.median(t) * 1e3, 3),
                       "vs_bf16": round(statistics.median(t) * 1e3 / base_ms, 3)} for label, t in times.items()}
    step = case("bf16 dropout 0.1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        try:
            step(0)
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("default")
    # torch's notice that the debug mode is a prototype is not a synchronisation
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message) and "prototype" not in str(w.message)]
    results["bf16 dropout 0.1"]["host_syncs"] = syncs
    path.write_text(json.dumps({"shape": list(shape), "device": device, "cases": results}, indent=1))


def summary_text(report: dict) -> str:
    env = report["environment"]
    lines = [f"GPU check {report['finished']}: {report['verdict']}"]
    if env.get("gpu"):
        lines.append(f"GPU {env['gpu']} (sm_{env['capability'].replace('.', '')}, {env['gpu_memory_gib']} GiB), "
                     f"driver {env.get('driver')}, torch {env['torch']} (CUDA {env['torch_cuda']}), triton {env['triton']}, "
                     f"timm {env['timm']}, pytest {env['pytest']}")
    for name, part in report["parts"].items():
        line = f"- {name}: {part['status']}"
        if part.get("reason"):
            line += f" ({part['reason']})"
        if part.get("seconds") is not None:
            line += f" in {part['seconds']} s"
        if part.get("pytest"):
            line += f": {part['pytest']}"
        lines.append(line)
        for shape, ratios in (part.get("ratios") or {}).items():
            cells = [f"{label} {r['fwd_bwd_s']:.2f}x" + (f" (memory {r['peak_bytes']:.2f}x)" if "peak_bytes" in r else "")
                     for label, r in ratios.items() if label.endswith("/triton")]
            lines.append(f"    {shape} fwd+bwd vs SDPA: " + (", ".join(cells) or "no Triton case ran"))
        for run in part.get("runs") or []:
            if run["status"] == "ran":
                lines.append(f"    {run['run']}: {run['median_step_ms']} ms/step ({run.get('time_vs_softmax')}x softmax), "
                             f"peak {run['peak_gib']} GiB, graph breaks {run['graph_breaks']}")
            else:
                lines.append(f"    {run['run']}: {run['status']} ({run.get('reason')})")
        decoder = part.get("decoder")
        if decoder:
            lines.append(f"    decoder {decoder['parameters'] / 1e9:.2f}B, batch {decoder['batch']}: "
                         + ", ".join(f"{k} {v} ms/step" for k, v in decoder["median_step_ms"].items())
                         + f"; poly3 {decoder['poly3_vs_softmax']}x softmax (target <= {decoder['target']}: "
                         + f"{'MET' if decoder['met'] else 'MISS'}), peak {decoder['peak_gib']} GiB")
        for label, case in ((part.get("cases") or {}).get("cases") or {}).items():
            lines.append(f"    {label}: {case['median_ms']} ms fwd+bwd ({case['vs_bf16']}x bf16)"
                         + (f", host syncs: {len(case['host_syncs'])}" if "host_syncs" in case else ""))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("outdir", type=Path, help="folder for gpu_check.json, summary.txt and the parts' files")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)} (default: all)")
    parser.add_argument("--workers", type=_workers, default=0,
                        help="pytest-xdist workers for the tests part (default 0: one process)")
    parser.add_argument("--limits", type=_limits, default={},
                        help="seconds per part, e.g. tests=240,bench=120 (default: LIMITS, sized for a cold GPU)")
    parser.add_argument("--vit-step", action="store_true", help=argparse.SUPPRESS)  # the vit part's subprocess
    parser.add_argument("--timing", action="store_true", help=argparse.SUPPRESS)  # the timing part's subprocess
    parser.add_argument("--decoder-step", action="store_true", help=argparse.SUPPRESS)  # the decoder part's
    parser.add_argument("--dry-run", action="store_true",
                        help="run the timing cases on CPU at a tiny shape into OUTDIR/timing.json (no GPU)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return 3 if exit_.code else 0
    if args.vit_step:
        vit_step(args.outdir)
        return 0
    if args.timing:
        timing_cases(args.outdir)
        return 0
    if args.decoder_step:
        decoder_steps(args.outdir)
        return 0
    if args.dry_run:
        args.outdir.mkdir(parents=True, exist_ok=True)
        timing_cases(args.outdir / "timing.json", device="cpu", shape=(1, 2, 40, 16), repeats=1)
        tiny = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=64)
        decoder_steps(args.outdir / "decoder.json", device="cpu", config=tiny, batch=(2, 16), steps=2)
        print(summary_text({"finished": "dry run", "verdict": "DRY RUN on CPU", "environment": environment(),
                            "parts": {"timing": {"status": "ran", "cases": json.loads(
                                (args.outdir / "timing.json").read_text())},
                                      "decoder": {"status": "ran", "decoder": json.loads(
                                          (args.outdir / "decoder.json").read_text())}}}), end="")
        return 0
    parts = args.parts.split(",")
    if not set(parts) <= set(PARTS):
        print(f"unknown parts {sorted(set(parts) - set(PARTS))}; expected some of {PARTS}", file=sys.stderr)
        return 3
    LIMITS.update(args.limits)
    args.outdir.mkdir(parents=True, exist_ok=True)
    env = environment()
    report = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "environment": env, "parts": {}}
    if not env["cuda_available"]:
        print(f"NO GPU: PyTorch {env['torch']} (CUDA build {env['torch_cuda']}) sees no CUDA device, so nothing "
              "was checked. Run this on a machine with an NVIDIA GPU.")
        report["parts"] = {name: {"status": "skipped", "reason": "no CUDA GPU"} for name in parts}
        report["verdict"] = "NO GPU: nothing checked"
        code = NO_GPU
    else:
        if tuple(int(x) for x in env["torch"].split("+")[0].split(".")[:2]) < (2, 6):
            print(f"warning: torch {env['torch']} is older than the 2.6 the package needs", file=sys.stderr)
        if env["unmet_pins"]:
            print("warning: parts that import the project may fail on these (install or carry the admitted "
                  f"versions): {'; '.join(env['unmet_pins'])}", file=sys.stderr)
        runners = {"tests": part_tests, "bench": part_bench, "vit": part_vit, "timing": part_timing,
                   "decoder": part_decoder}
        for name in parts:
            print(f"[gpu_check] {name} (at most {LIMITS[name]} s) ...", flush=True)
            options = {"workers": args.workers} if name == "tests" else {}
            report["parts"][name] = runners[name](env, args.outdir, **options)
            print(f"[gpu_check] {name}: {report['parts'][name]['status']}", flush=True)
            # written after every part: a run stopped from outside keeps the parts that finished
            (args.outdir / "gpu_check.json").write_text(json.dumps(report, indent=1))
        bad = [name for name, part in report["parts"].items() if part["status"] in ("failed", "timeout")]
        report["verdict"] = f"FAILED: {', '.join(bad)}" if bad else "PASSED (skipped parts listed below)"
        code = 1 if bad else 0
    report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    (args.outdir / "gpu_check.json").write_text(json.dumps(report, indent=1))
    text = summary_text(report)
    (args.outdir / "summary.txt").write_text(text)
    print(text, end="")
    return code


if __name__ == "__main__":
    sys.exit(main())
