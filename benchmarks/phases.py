"""Where a training step's time goes, for the side-by-side benchmarks: seconds per phase per side, and the
achieved FLOP/s of each phase as a fraction of the matmul peak measured in the same run.

`PhaseClock` wraps callables in place (`clock.wrap(owner, "name", "phase")`) and keeps exclusive time: a
phase nested in another (the forward inside TRL's compute_loss) is charged to the inner one, the rest of the
outer stays the outer's. Time outside every wrapped phase but inside `clock.step(side)` is "other" (Python
glue, data collation, logging not wrapped). Backward (`torch.autograd.backward`, which `Tensor.backward`
calls) and the optimizer step (torch's global optimizer step hooks) are caught for both sides the same way.

FLOPs are counted for the positions each side actually computes (`flops_forward`): 2·N_body per position
through the transformer body (N_body = matmul parameters of the layers; attention's QK^T/AV terms are small
at these lengths and left out, so achieved values are slight underestimates) plus 2·V·H per position where
logits are formed; backward is 2x the forward (grad of inputs and of weights). A phase without a FLOP
model (reward, optimizer, logging) shows only its seconds. Peak: `posttrain.plan.cpu.matmul_rate` measured
now (not the cache), at the run's thread count and dtype.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch


class PhaseClock:
    """Exclusive seconds per (side, phase) over the steps run inside `step(side)`."""

    def __init__(self):
        self.seconds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.flops: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.steps: dict[str, int] = defaultdict(int)
        self.side: str | None = None
        self.stack: list[str] = []
        self.mark = 0.0
        self.counting = True  # False during warm-up steps
        self._undo: list[Callable[[], None]] = []

    def _charge(self) -> None:
        now = time.perf_counter()
        if self.side is not None and self.counting:
            self.seconds[self.side][self.stack[-1] if self.stack else "other"] += now - self.mark
        self.mark = now

    def start(self, side: str, counting: bool = True) -> None:
        """Begin one step of `side` (counting=False: a warm-up step, not in the table)."""
        self.side, self.counting, self.stack, self.mark = side, counting, [], time.perf_counter()

    def stop(self) -> None:
        if self.side is not None:
            self._charge()
            self.steps[self.side] += self.counting
            self.side = None

    @contextlib.contextmanager
    def step(self, side: str, counting: bool = True) -> Iterator[None]:
        self.start(side, counting)
        try:
            yield
        finally:
            self.stop()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.side is None:  # outside a timed step (set-up, the other side's untimed code)
            yield
            return
        self._charge()
        self.stack.append(name)
        try:
            yield
        finally:
            self._charge()
            self.stack.pop()

    def parent(self) -> str | None:
        return self.stack[-1] if self.stack else None

    def add_flops(self, phase: str, flops: float) -> None:
        if self.side is not None and self.counting:
            self.flops[self.side][phase] += flops

    def wrap(self, owner, name: str, phase: str | Callable[[PhaseClock], str],
             flops: Callable[[tuple, dict, object], float] | None = None) -> None:
        """Replace `owner.name` by a timed version (undone by `restore`); `phase` may depend on the parent
        phase; `flops(args, kwargs, result)` counts the call's FLOPs into its phase."""
        original = getattr(owner, name)

        def timed(*a, **k):
            label = phase(self) if callable(phase) else phase
            with self.phase(label):
                result = original(*a, **k)
            if flops is not None:
                self.add_flops(label, flops(a, k, result))
            return result

        setattr(owner, name, timed)
        self._undo.append(lambda: setattr(owner, name, original))

    def hook_torch(self) -> None:
        """Backward and optimizer steps of both sides (torch's own entry points and global hooks)."""
        self.wrap(torch.autograd, "backward", "backward")
        for clip in ("clip_grad_norm_", "get_total_norm", "clip_grads_with_norm_"):  # posttrain's optim calls the last two
            self.wrap(torch.nn.utils, clip, "optimizer")
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        pre = register_optimizer_step_pre_hook(lambda *a: self._enter("optimizer"))
        post = register_optimizer_step_post_hook(lambda *a: self._exit())
        self._undo += [pre.remove, post.remove]

    def _enter(self, name: str) -> None:
        if self.side is not None:
            self._charge()
            self.stack.append(name)

    def _exit(self) -> None:
        if self.side is not None and self.stack:
            self._charge()
            self.stack.pop()

    def restore(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def per_step(self, side: str) -> dict[str, float]:
        n = max(self.steps[side], 1)
        return {k: v / n for k, v in self.seconds[side].items()}


def body_params(model) -> int:
    """Matmul parameters of the transformer body: every 2-D weight except the embedding and the lm head."""
    skip = {id(model.get_input_embeddings().weight)}
    out = model.get_output_embeddings()
    if out is not None:
        skip.add(id(out.weight))
    return sum(p.numel() for p in model.parameters() if p.dim() == 2 and id(p) not in skip)


def flops_forward(n_body: int, vocab_hidden: int, positions: float, logit_positions: float) -> float:
    """2·N_body per position through the body + 2·V·H per position whose logits are formed."""
    return 2.0 * n_body * positions + 2.0 * vocab_hidden * logit_positions


def stock_model(name: str, **kw):
    """The model as a TRL user loads it: posttrain's loader (the same weights, GGUF conversion and cache) with
    transformers' own attention and torch.nn.Linear (no oneDNN swap, ops/linear.py). The process-wide malloc
    setting of ops/host_memory.py is switched per side by `Allocator`."""
    from posttrain.models.loading import load_model
    from posttrain.ops.linear import use_onednn_linears

    model = load_model(name, varlen_attention=False, **kw)
    use_onednn_linears(model, enabled=False)
    return model


class Allocator:
    """The malloc settings each side runs under, switched at every hand-over between the sides: posttrain its
    own (ops/host_memory.py keeps freed blocks), the competitor glibc's steady-state defaults (blocks above
    32 MiB mapped and unmapped per use), as each would run in its own process. `shared` (--shared-malloc)
    leaves posttrain's settings on for both: the competitor then gains from them too."""

    def __init__(self, shared: bool = False):
        self.shared = shared

    def side(self, name: str) -> None:
        from posttrain.ops.host_memory import glibc_steady_state

        if not self.shared:
            glibc_steady_state(on=name != "posttrain")

    @staticmethod
    def add_flag(parser) -> None:
        parser.add_argument("--shared-malloc", action="store_true",
                            help="the competitor runs under posttrain's malloc settings too (default: glibc's, "
                                 "as in its own process)")


def measure_peak(dtype: str, threads: int) -> float:
    """FLOP/s of a large matmul in `dtype` at `threads` threads, measured now (best of short trials): the
    faster of posttrain's kernel (fp32: oneDNN or the packed GEMM, ops/linear.py) and torch.matmul (fp32: the BLAS)."""
    from posttrain.plan import cpu

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return max(cpu.matmul_rate(dtype), cpu.matmul_rate(dtype, kernel=torch.matmul))
    finally:
        torch.set_num_threads(saved)


ORDER = ["generate", "reward", "prepare", "old/ref log-probs", "reference", "loss", "forward", "backward", "optimizer",
         "weight sync", "kl probe", "logging", "other"]


def table(clock: PhaseClock, sides: list[str], peak: float) -> str:
    """Per-phase seconds per step of each side, with achieved GFLOP/s and % of the measured peak."""
    phases = [p for p in ORDER if any(p in clock.seconds[s] for s in sides)]
    phases += sorted({p for s in sides for p in clock.seconds[s]} - set(phases))
    head = f"{'phase':20s}" + "".join(f"{s + ' s/step':>18s}{'GFLOP/s':>9s}{'%peak':>7s}" for s in sides)
    lines = [f"per-phase breakdown (mean over the timed steps); matmul peak {peak / 1e9:.1f} GFLOP/s measured now",
             head]
    totals = dict.fromkeys(sides, 0.0)
    for p in phases:
        cells = []
        for s in sides:
            sec, n = clock.seconds[s].get(p, 0.0), max(clock.steps[s], 1)
            totals[s] += sec / n
            fl = clock.flops[s].get(p)
            rate = fl / sec if fl and sec > 0 else None
            cells.append(f"{sec / n:18.3f}" + (f"{rate / 1e9:9.1f}{100 * rate / peak:6.0f}%" if rate else f"{'—':>9s}{'':>7s}"))
        lines.append(f"{p:20s}" + "".join(cells))
    lines.append(f"{'total':20s}" + "".join(f"{totals[s]:18.3f}{'':16s}" for s in sides))
    floors = {s: floor(clock, s, peak) for s in sides}
    lines.append(f"{'its FLOPs at peak':20s}" + "".join(
        f"{floors[s]:18.3f}{100 * floors[s] / totals[s] if totals[s] else 0:15.0f}%" for s in sides))
    lines.append("(the last row: the counted FLOPs of each side's step at the peak rate, a floor for that side's work, "
                 "and that floor as a share of its step)")
    if len(sides) == 2 and floors[sides[1]] > 0:
        first, last = sides
        lines.append(f"ceiling: {first}'s step / {last}'s floor = {totals[first] / floors[last]:.2f}x, the most {last} "
                     f"could be faster than this {first} step with its counted FLOPs all at the peak and nothing else")
    return "\n".join(lines)


def floor(clock: PhaseClock, side: str, peak: float) -> float:
    """Seconds per step that `side`'s counted FLOPs take at the peak rate: its step's arithmetic floor."""
    return sum(clock.flops[side].values()) / max(clock.steps[side], 1) / peak


def as_json(clock: PhaseClock, sides: list[str], peak: float) -> dict:
    out = {"peak_flops": peak, "floor_s_per_step": {s: floor(clock, s, peak) for s in sides}}
    for s in sides:
        n = max(clock.steps[s], 1)
        out[s] = {p: {"s_per_step": sec / n, "flops_per_s": (clock.flops[s].get(p, 0.0) / sec) if sec > 0 else None}
                  for p, sec in clock.seconds[s].items()}
    return out


class Trace:
    """`--profile DIR`: a torch profiler trace of one step per side, `DIR/<side>.json` (chrome trace format),
    and the top operators by self CPU time printed."""

    def __init__(self, folder: str | None):
        self.folder, self.prof, self.side, self.done = folder, None, None, set()

    def start(self, side: str) -> None:
        if not self.folder or side in self.done:
            return
        from torch.profiler import ProfilerActivity, profile

        self.prof, self.side = profile(activities=[ProfilerActivity.CPU], record_shapes=True), side
        self.prof.__enter__()

    def stop(self) -> None:
        if self.prof is None:
            return
        self.prof.__exit__(None, None, None)
        from pathlib import Path

        path = Path(self.folder) / f"{self.side}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        self.prof.export_chrome_trace(str(path))
        print(f"profile of one {self.side} step: {path} (chrome://tracing or https://ui.perfetto.dev)", flush=True)
        print(self.prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12), flush=True)
        self.done.add(self.side)
        self.prof, self.side = None, None


def alternate(clock: PhaseClock, trace: Trace, malloc: Allocator, warmup: int, posttrain_step: Callable[[int], dict],
              after_trl: Callable[[], None] | None = None, line: Callable[[dict], str] | None = None):
    """A transformers TrainerCallback that runs one posttrain step right after each TRL step, so the two sides
    alternate in one process and are timed the same way: `.trl` and `.pt` seconds per step, `.pt_rows` posttrain's
    metric rows. posttrain_step(i) -> row; after_trl() runs at TRL's step end, before posttrain's step (to read
    TRL's metrics of that step); line(row) adds to the step's printed line. The profiler trace (`Trace`) covers
    the last warm-up step of each side, so tracing does not skew the timed steps."""
    from transformers import TrainerCallback

    class Alternate(TrainerCallback):
        def __init__(self):
            self.mark, self.trl, self.pt, self.pt_rows = None, [], [], []

        def on_train_begin(self, a, state, control, **kw):
            malloc.side("trl")
            self.mark = time.perf_counter()

        def on_step_begin(self, a, state, control, **kw):
            if len(self.pt) == warmup - 1:  # the last warm-up step: the trace does not skew the timing
                trace.start("trl")
            clock.start("trl", counting=len(self.pt) >= warmup)

        def on_step_end(self, a, state, control, **kw):
            clock.stop()
            trace.stop()
            t = time.perf_counter()
            self.trl.append(t - self.mark)
            if after_trl is not None:
                after_trl()
            if len(self.pt) == warmup - 1:
                trace.start("posttrain")
            malloc.side("posttrain")
            with clock.step("posttrain", counting=len(self.pt) >= warmup):
                row = posttrain_step(len(self.pt))
            malloc.side("trl")
            trace.stop()
            self.pt.append(time.perf_counter() - t)
            self.pt_rows.append(row)
            extra = line(row) if line is not None else ""
            print(f"step {len(self.pt):3d}  trl {self.trl[-1]:6.2f}s  posttrain {self.pt[-1]:6.2f}s{extra}", flush=True)
            self.mark = time.perf_counter()

    return Alternate()
