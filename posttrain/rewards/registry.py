"""Reward registry and weighted composition (docs/rewards.md).

Every reward has the signature of TRL's reward functions:

    f(prompts, completions, **columns) -> list[float | None]     # None = "does not apply, skip"

`completions` may be strings or conversations (`[{"role", "content"}, ...]`); `completion_text`
takes the last assistant message. Extra dataset columns (`answer`, `tests`, ...) arrive as keyword
arguments, one list per column. Register your own with `posttrain.rewards.base.register` (the table,
`register`, `RewardSpec` and `RewardError` live there, below the built-in rewards that register
themselves; this module imports those and looks names up):

    from posttrain.rewards.base import completion_text, register
    @register("shout", columns=())
    def shout(prompts, completions, **kw):
        return [float(completion_text(c).isupper()) for c in completions]

`compose("math:1.0,format:0.2")` builds the weighted sum r = Σ_i w_i r_i over the rewards that are
not None for a sample (TRL's nansum semantics; all None -> None), with per-reward metrics. A reward
that raises or returns NaN/inf is never turned into 0: it raises `RewardError` naming the reward
and the sample, or, with `on_error="record"`, the value becomes None and the error is listed in
`last_errors` with the sample index.

A reward can also live in the user's own file: `compose("math:1.0,my.py:brevity:0.1")` loads
`brevity` from `my.py` (see `load_file_reward`); it is named `my.py:brevity` in metrics and errors.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import inspect
import math
import re
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import posttrain.rewards.code
import posttrain.rewards.format
import posttrain.rewards.judge
import posttrain.rewards.language
import posttrain.rewards.math
import posttrain.rewards.shaping  # noqa: F401 - importing the built-ins registers them
from posttrain.errors import UserError
from posttrain.rewards.base import REGISTRY, RewardError, RewardFn, RewardSpec

_FILE_REWARDS: dict[str, RewardSpec] = {}  # 'file.py:function' -> the most recently loaded one
_MODULES: dict[Path, ModuleType] = {}  # resolved path -> module: each file is executed once


def get(name: str) -> RewardSpec:
    """A registered reward, or a file reward already loaded by `parse_spec`/`load_file_reward`."""
    if name in REGISTRY:
        return REGISTRY[name]
    if name in _FILE_REWARDS:
        return _FILE_REWARDS[name]
    if name.startswith("rm:"):  # a trained reward-model folder: rm:PATH (rewards/reward_model.py)
        from posttrain.rewards.reward_model import reward_model_spec  # torch, transformers

        return reward_model_spec(name)
    close = difflib.get_close_matches(name, list(REGISTRY), n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    raise UserError(f"unknown reward '{name}'{hint} (known: {', '.join(sorted(REGISTRY))}; "
                    "or a function in your file: path/to/file.py:function)")


def names() -> list[str]:
    return sorted(REGISTRY)


RESERVED_COLUMNS = {"prompts": "prompt", "completions": "completion"}  # the reward call's own argument names


def reserved_column(row: dict) -> tuple[str, str] | None:
    """(column, what it collides with) for a dataset column named like the arguments a reward receives the prompts and
    completions in (TRL's f(prompts, completions, **columns) cannot take it), else None."""
    for col, single in RESERVED_COLUMNS.items():
        if col in row:
            return col, (f"the argument rewards receive the {col} in (f(prompts, completions, **columns)); rename the "
                         f"column (the {single} column is `{single}`)")
    return None


def parse_spec(spec: str | dict | list) -> list[tuple[str, float]]:
    """'math:1.0,my.py:brevity:0.2' | {'math': 1.0} | [('math', 1.0)] -> [(name, weight)]; weight
    defaults to 1. File rewards (`path.py:function`) are loaded here and named `file.py:function`."""
    if isinstance(spec, dict):
        items = list(spec.items())
    elif isinstance(spec, (list, tuple)):
        items = [(s, 1.0) if isinstance(s, str) else tuple(s) for s in spec]
    else:
        items = [_split_weight(part.strip()) for part in str(spec).split(",") if part.strip()]
    if not items:
        raise UserError(f"reward spec '{spec}' names no reward")
    out: list[tuple[str, float]] = []
    sources: dict[str, str] = {}  # two files with the same name and function would share metrics
    for ref, w in items:
        name = _resolve(str(ref).strip(), sources)
        try:
            weight = float(w) if str(w).strip() else 1.0
        except (TypeError, ValueError):
            raise UserError(f"reward spec '{spec}': weight of '{ref}' is not a number: {w!r}") from None
        if not math.isfinite(weight):
            raise UserError(f"reward spec '{spec}': weight of '{ref}' must be finite")
        if any(name == n for n, _ in out):  # the sum would count it twice while its breakdown shows it once
            total = sum(w for n, w in out if n == name) + weight
            raise UserError(f"reward spec '{spec}': '{name}' appears twice; give it once with the weight you mean "
                            f"('{name}:{total:g}' for the sum of both)")
        out.append((name, weight))
    return out


def _split_weight(part: str) -> tuple[str, str]:
    """'math:0.5' -> ('math', '0.5'); 'dir/my.py:fn:0.5' -> ('dir/my.py:fn', '0.5')."""
    if part.startswith("rm:"):  # 'rm:runs/rm/final:0.5' -> ('rm:runs/rm/final', '0.5')
        from posttrain.rewards.reward_model import split_weight  # torch, transformers

        return split_weight(part)
    ref = _file_ref(part)
    if ref is None:
        name, _, w = part.partition(":")
        return name.strip(), w
    path, rest = ref
    fn, _, w = rest.partition(":")
    return f"{path}:{fn}" if fn else path, w


def _resolve(ref: str, sources: dict[str, str]) -> str:
    """Check a reference and return the reward's name; a file reference loads the file."""
    if ref.startswith("rm:") or _file_ref(ref) is None:
        return get(ref).name
    spec = load_file_reward(ref)
    if sources.setdefault(spec.name, spec.source) != spec.source:
        raise UserError(f"two file rewards are named '{spec.name}' ({sources[spec.name]} and {spec.source}): "
                        "rename one file or function")
    return spec.name


# ---------------------------------------------------------------- rewards from the user's files

_FILE_REF = re.compile(r"^(?P<path>.*?\.py)(?::(?P<rest>.*))?$")


def _file_ref(text: str) -> tuple[str, str] | None:
    """'dir/my.py:fn[:w]' -> ('dir/my.py', 'fn[:w]'); None when `text` names a registered reward."""
    m = _FILE_REF.match(text.strip())
    return (m["path"], m["rest"] or "") if m else None


def file_reward_name(ref: str) -> str:
    """The metric name of a file reference: 'dir/my.py:fn' -> 'my.py:fn'; other names unchanged."""
    parsed = _file_ref(ref)
    if parsed is None or not parsed[1]:
        return ref
    return f"{Path(parsed[0]).name}:{parsed[1].partition(':')[0]}"


def load_file_reward(ref: str) -> RewardSpec:
    """Load `function` from `path/to/file.py` ('path/to/file.py:function'; relative to the current
    directory) as a reward named 'file.py:function'.

    The function has TRL's signature `f(prompts, completions, **kwargs) -> list[float | None]` and
    is called with keyword arguments: every dataset column (and `completion_ids` when the trainer
    passes them) arrives as a keyword; a function without `**kwargs` receives only the ones it names.
    It declares no required columns unless it has an attribute `columns = ("answer",)`. Options
    (`compose(..., options={"file.py:function": {...}})`) are added as keyword arguments on every
    call and win over a dataset column of the same name.
    """
    path_text, rest = _file_ref(ref) or (ref, "")
    fn_name = rest.partition(":")[0].strip()
    if not fn_name.isidentifier():
        raise UserError(f"reward '{ref}': name the function in the file: {path_text}:FUNCTION[:WEIGHT]")
    module, path = _load_module(path_text)
    name = f"{path.name}:{fn_name}"
    fn = _find_function(module, fn_name, path_text)
    accepts = _keywords(fn, name)
    columns = _declared_columns(fn, name)
    doc = (inspect.getdoc(fn) or f"{fn_name} from {path}").split("\n")[0]
    spec = RewardSpec(name, _FileReward(fn, {}, accepts, name), columns, doc,
                      factory=lambda **options: _FileReward(fn, options, accepts, name), source=str(path))
    _FILE_REWARDS[name] = spec
    return spec


def _load_module(path_text: str) -> tuple[ModuleType, Path]:
    path = Path(path_text).expanduser().resolve()
    if path in _MODULES:
        return _MODULES[path], path
    if not path.is_file():
        raise UserError(f"reward file not found: {path_text} (looked for {path})")
    # a unique module name per path: two `rewards.py` in different folders must not collide
    stem = re.sub(r"\W", "_", path.stem)
    mod_name = f"posttrain_user_reward_{stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module  # dataclasses and pickling look the module up while it runs
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[mod_name]
        lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if Path(f.filename) == path]
        where = f":{lines[-1]}" if lines else ""
        raise UserError(f"reward file {path_text}{where}: importing it failed: {type(e).__name__}: {e}") from e
    _MODULES[path] = module
    return module, path


def _find_function(module: ModuleType, fn_name: str, path_text: str) -> Callable:
    if not hasattr(module, fn_name):
        funcs = sorted(n for n, v in vars(module).items()
                       if inspect.isfunction(v) and v.__module__ == module.__name__ and not n.startswith("_"))
        close = difflib.get_close_matches(fn_name, funcs, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise UserError(f"{path_text} has no function '{fn_name}'{hint} "
                        f"(functions in it: {', '.join(funcs) or 'none'})")
    fn = getattr(module, fn_name)
    if not callable(fn):
        raise UserError(f"{path_text}:{fn_name} is a {type(fn).__name__}, not a function")
    return fn


def _keywords(fn: Callable, name: str) -> set[str] | None:
    """The keyword names `fn` accepts, or None when it takes **kwargs (or has no readable signature)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if "completions" not in names:
        raise UserError(f"reward '{name}' must take `completions` as a keyword argument "
                        "(TRL signature: f(prompts, completions, **kwargs))")
    return names


def _declared_columns(fn: Callable, name: str) -> tuple:
    cols = getattr(fn, "columns", ())
    cols = (cols,) if isinstance(cols, str) else cols
    ok = isinstance(cols, (tuple, list)) and all(
        isinstance(c, str) or (isinstance(c, tuple) and all(isinstance(a, str) for a in c)) for c in cols)
    if not ok:
        raise UserError(f"reward '{name}': `columns` must be a tuple of column names, got {cols!r}")
    return tuple(cols)


class _FileReward:
    """A user's function called the TRL way (keywords), with its options added on every call."""

    def __init__(self, fn: Callable, options: dict, accepts: set[str] | None, name: str):
        unknown = sorted(set(options) - accepts) if accepts is not None else []
        if unknown:
            raise UserError(f"reward '{name}': no parameter named {', '.join(unknown)} "
                            f"(it takes {', '.join(sorted(accepts))})")
        self.fn, self.options, self.accepts, self.__name__ = fn, dict(options), accepts, name
        self.timeout = file_reward_timeout(fn, name)  # a bad `timeout` attribute is refused when the file loads

    def __call__(self, prompts, completions, **columns):
        kwargs = {"prompts": prompts, "completions": completions, **columns, **self.options}
        if self.accepts is not None:  # no **kwargs: pass only what it names (TRL would fail instead)
            kwargs = {k: v for k, v in kwargs.items() if k in self.accepts}
        return watched_call(self.fn, kwargs, self.__name__, self.timeout)

    @property
    def last_metrics(self):  # a function's own counters reach the metrics like a built-in's
        return getattr(self.fn, "last_metrics", None)


class RewardStop(RewardError):
    """A reward that cannot go on (overran its time limit, tried to end the process): the run stops, whatever
    `on_error` says (recording it per batch would wait out the limit again on every batch)."""


FILE_REWARD_TIMEOUT_S = 60.0  # a user function's call that has not returned by then stops the run (docs/rewards.md)


def file_reward_timeout(fn: Callable, name: str) -> float | None:
    """Seconds one call of a file reward may take: its `timeout` attribute (`fn.timeout = 5`; 0 or None = no
    limit), else FILE_REWARD_TIMEOUT_S."""
    value = getattr(fn, "timeout", FILE_REWARD_TIMEOUT_S)
    if value is not None and not (isinstance(value, (int, float)) and value >= 0):
        raise UserError(f"reward '{name}': `timeout` must be a number of seconds >= 0 (0 = no limit), got {value!r}")
    return float(value) if value else None


def watched_call(fn: Callable, kwargs: dict, name: str, timeout: float | None):
    """`fn(**kwargs)` in a watchdog thread: a call that overruns `timeout` s, or ends the process
    (`sys.exit`, `exit()`), becomes a RewardError naming the reward; any other exception propagates as is
    (call_reward reports it per sample). A call that overran keeps running in its daemon thread, which the
    process does not wait for at exit (Python cannot kill a thread)."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn(**kwargs)
        except BaseException as e:  # handed to the caller's thread below, SystemExit included
            box["error"] = e

    thread = threading.Thread(target=target, name=f"reward {name}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise RewardStop(name, [(None, f"did not return within {timeout:g} s (a file reward's time limit: set "
                                        f"`{getattr(fn, '__name__', 'fn')}.timeout = SECONDS` in its file, 0 = none)")])
    error = box.get("error")
    if isinstance(error, SystemExit):
        where = getattr(fn, "__code__", None)
        file = f" ({where.co_filename})" if where is not None else ""
        raise RewardStop(name, [(None, f"called sys.exit({error.code!r}){file}: a reward must return a list of "
                                        "values (None where it does not apply), or raise an exception")])
    if error is not None:
        raise error.with_traceback(error.__traceback__)
    return box["value"]


def _check_values(name: str, values: Any, n: int) -> tuple[list, list[tuple[int | None, str]]]:
    if not isinstance(values, (list, tuple)) or len(values) != n:
        got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
        return [None] * n, [(None, f"must return a list of {n} values, got {got}")]
    out, errors = [], []
    for i, v in enumerate(values):
        if v is None:
            out.append(None)
            continue
        try:
            f = float(v)
        except (TypeError, ValueError):
            out.append(None)
            errors.append((i, f"returned a non-number: {v!r}"))
            continue
        if not math.isfinite(f):
            out.append(None)
            errors.append((i, f"returned {f}"))
            continue
        out.append(f)
    return out, errors


def call_reward(name: str, fn: RewardFn, prompts: list, completions: list, columns: dict) -> tuple[list, list]:
    """Call one reward; on an exception, re-run sample by sample to name the culprits."""
    n = len(completions)
    try:
        values = fn(prompts, completions, **columns)
    except RewardStop:
        raise
    except RewardError as e:  # built-in rewards report per-sample errors themselves
        vals = e.values if e.values is not None else [None] * n
        out, errs = _check_values(name, vals, n)
        return out, e.errors + errs
    except Exception as e:  # any failure of a reward is reported, per sample
        if n <= 1:
            return [None] * n, [(0 if n else None, f"{type(e).__name__}: {e}")]
        out, errors = [], []
        for i in range(n):
            sub = {k: v[i:i + 1] for k, v in columns.items()}
            o, errs = call_reward(name, fn, prompts[i:i + 1], completions[i:i + 1], sub)
            out.extend(o)
            errors.extend((i, m) for _, m in errs)
        return out, errors
    return _check_values(name, values, n)


@dataclass
class ComposedReward:
    """Σ w_i r_i over registered rewards, TRL-compatible (`__name__` set for TRL's logging)."""

    parts: list[tuple[str, float]]
    on_error: str = "raise"  # or "record"
    options: dict = field(default_factory=dict)  # reward name -> factory options
    last_metrics: dict = field(default_factory=dict)
    last_values: dict = field(default_factory=dict)  # name -> list of per-sample values
    last_errors: list = field(default_factory=list)  # [{"reward", "index", "error"}]

    def __post_init__(self):
        self.__name__ = "+".join(n for n, _ in self.parts)
        # options for a file reward may be keyed by its path as written ('dir/my.py:fn')
        self.options = {file_reward_name(k): v for k, v in self.options.items()}
        unknown = set(self.options) - {n for n, _ in self.parts}
        if unknown:
            raise UserError(f"options given for rewards not in the composition: {sorted(unknown)}")
        # resolved now: a later load of another 'my.py:fn' must not change this composition
        self.specs = {n: get(n) for n, _ in self.parts}
        self.fns = {n: spec.build(self.options.get(n)) for n, spec in self.specs.items()}

    @property
    def columns(self) -> dict[str, tuple]:
        return {n: spec.columns for n, spec in self.specs.items()}

    @property
    def verifiers(self) -> list[str]:
        """The parts that check against a ground-truth column (answer, tests): the task's own verdict, as
        opposed to shaping terms (format, length, a bonus of the user's) that read only the completion."""
        return [n for n, spec in self.specs.items() if spec.columns]

    def verifier_part(self) -> "ComposedReward | None":
        """The verifier parts alone (the trusted held-out reward when shaping terms are mixed in), or None
        when the composition is all verifiers or has none."""
        keep = [(n, w) for n, w in self.parts if n in self.verifiers]
        if not keep or len(keep) == len(self.parts):
            return None
        return ComposedReward(keep, on_error="record", options={n: v for n, v in self.options.items() if n in dict(keep)})

    def __call__(self, prompts: list, completions: list, **columns) -> list[float | None]:
        n = len(completions)
        prompts = list(prompts) if prompts is not None else [None] * n
        total: list[float | None] = [None] * n
        self.last_metrics, self.last_values, self.last_errors = {}, {}, []
        for name, w in self.parts:
            t0 = time.perf_counter()
            values, errors = call_reward(name, self.fns[name], prompts, completions, columns)
            dt = time.perf_counter() - t0
            if errors and self.on_error == "raise":
                raise RewardError(name, errors, values, samples=completions)
            self.last_errors += [{"reward": name, "index": i, "error": m} for i, m in errors]
            self.last_values[name] = values
            got = [v for v in values if v is not None]
            mean = sum(got) / len(got) if got else float("nan")
            std = math.sqrt(sum((v - mean) ** 2 for v in got) / len(got)) if got else float("nan")
            self.last_metrics.update({
                f"rewards/{name}/mean": mean, f"rewards/{name}/std": std,
                f"rewards/{name}/none": n - len(got) - len(errors), f"rewards/{name}/errors": len(errors),
                f"rewards/{name}/seconds": dt,
            })
            extra = getattr(self.fns[name], "last_metrics", None)
            if isinstance(extra, dict):
                self.last_metrics.update({f"rewards/{name}/{k}": v for k, v in extra.items()})
            for i, v in enumerate(values):
                if v is not None:
                    total[i] = (total[i] or 0.0) + w * v
        return total


def compose(spec: str | dict | list, on_error: str = "raise", options: dict | None = None) -> ComposedReward:
    """`compose("math:1.0,format:0.2", options={"math": {"require": "answer_tag"}})` -> a callable
    reward with TRL's signature. Parts may be files: `compose("math,my.py:brevity:0.1",
    options={"my.py:brevity": {"max_words": 50}})` (see `load_file_reward`)."""
    if on_error not in ("raise", "record"):
        raise ValueError("on_error must be 'raise' or 'record'")
    return ComposedReward(parse_spec(spec), on_error=on_error, options=dict(options or {}))
