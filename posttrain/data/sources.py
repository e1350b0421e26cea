"""`data=` sources beyond local files: Hugging Face Hub datasets and weighted mixtures.

    data=trl-lib/Capybara                    a Hub dataset through `datasets.load_dataset`: its train split
    data=org/name:test                       a split (slices too: org/name:train[:1000])
    data=org/name:config:split               a configuration and a split
    data=a.jsonl:0.7,org/name:0.3            a mixture: every part ends with its weight

A Hub dataset loads from the Hugging Face datasets cache when it is there; otherwise it is downloaded. Offline
(HF_DATASETS_OFFLINE=1 or HF_HUB_OFFLINE=1, or the Hub not answering a 3-second probe) only the cache is read,
so a run without network never waits on retries; a dataset in neither place is refused at once, naming the
cache folder and why the Hub was not asked. The cache is datasets' own (HF_DATASETS_CACHE, else
HF_HOME/datasets, else ~/.cache/huggingface/datasets).

A mixture is by subsampling, not by sampling with replacement: with weights w_i (normalised) over sources of
n_i rows it holds k_i = floor(w_i · N) rows of source i, N = min_i n_i / w_i the largest total at which no
source runs out (so no row repeats and the proportions are exact); which rows, and their interleaved order,
are a seeded random choice (the recipe's `seed`): the same seed gives the same mixture. Each row keeps its
source and row number for error messages.
"""

from __future__ import annotations

import math
import os
import random
import re
from contextlib import contextmanager
from pathlib import Path

from posttrain.errors import UserError

# `org/name` (Hub-legal characters), then optionally `:split` or `:config:split`; a split may carry a slice
_PART = r"[^:,\[\]]+(?:\[[^\]]*\])?"
HUB_DATASET = re.compile(rf"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?::(?P<a>{_PART}))?(?::(?P<b>{_PART}))?")
FILE_SUFFIXES = (".jsonl", ".ndjson", ".json", ".parquet", ".csv", ".txt")
PROBE_TIMEOUT_S = 3.0
_TRUE = ("1", "true", "yes", "on")


def is_hub_dataset(name: str) -> bool:
    """`org/name[:split]` or `org/name:config:split`, not an existing path and not a missing data file."""
    m = HUB_DATASET.fullmatch(name)
    return m is not None and not Path(m["repo"]).exists() and not m["repo"].lower().endswith(FILE_SUFFIXES)


def parse_hub(name: str) -> tuple[str, str | None, str | None]:
    """'org/name' -> (repo, None, None); 'org/name:split' -> (repo, None, split); 'org/name:cfg:split'."""
    m = HUB_DATASET.fullmatch(name)
    if m["b"] is not None:
        return m["repo"], m["a"], m["b"]
    return m["repo"], None, m["a"]


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


def cache_dir() -> str:
    """The datasets cache, read from the environment now (HF_DATASETS_CACHE, HF_HOME/datasets) or datasets' default."""
    if os.environ.get("HF_DATASETS_CACHE"):
        return os.environ["HF_DATASETS_CACHE"]
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]) / "datasets")
    import datasets

    return str(datasets.config.HF_DATASETS_CACHE)


def hub_unreachable() -> str | None:
    """None when the Hub answers (any HTTP status) within PROBE_TIMEOUT_S; otherwise why not."""
    import httpx

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    try:
        httpx.head(endpoint, timeout=PROBE_TIMEOUT_S)
    except httpx.HTTPError as e:
        return f"{endpoint} did not answer ({type(e).__name__}: {e})"
    return None


def offline_reason() -> str | None:
    """Why only the cache may be read (offline variables set, or the Hub unreachable), or None when online."""
    import datasets

    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        if _env_true(var):
            return f"{var}=1"
    if datasets.config.HF_HUB_OFFLINE:
        return "offline mode (HF_DATASETS_OFFLINE / HF_HUB_OFFLINE at start-up)"
    return hub_unreachable()


@contextmanager
def _offline():
    """datasets' and huggingface_hub's offline switches on for one load (they are read at call time)."""
    import datasets
    from huggingface_hub import constants

    saved = datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE = saved


def load_hub(name: str) -> list[dict]:
    """The rows of a Hub dataset (`org/name[:config]:split`; no split: 'train', else the only or first split)."""
    import datasets

    repo, config, split = parse_hub(name)
    cache = cache_dir()
    reason = offline_reason()
    try:
        if reason is None:
            ds = datasets.load_dataset(repo, config, split=split, cache_dir=cache)
        else:
            with _offline():
                ds = datasets.load_dataset(repo, config, split=split, cache_dir=cache)
    except ValueError as e:  # an unknown split or configuration: datasets names the ones there are
        raise UserError(f"data '{name}': {e}") from None
    except (ConnectionError, FileNotFoundError, datasets.exceptions.DatasetNotFoundError) as e:
        where = f"not in the datasets cache ({cache}), and the Hub was not tried ({reason})" if reason else \
            f"not found on the Hub nor in the datasets cache ({cache}): {e}"
        raise UserError(f"data '{name}' is no local file or folder, and as a Hub dataset it is {where}. "
                        "Download it once with network (or copy the cache), or give a file") from None
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"] if "train" in ds else next(iter(ds.values()))
    return ds.to_list()


# ---------------------------------------------------------------- mixtures


def is_mixture(name: str) -> bool:
    return "," in name


def parse_mixture(spec: str) -> list[tuple[str, float]]:
    """'a.jsonl:0.7,org/name:0.3' -> [('a.jsonl', 0.7), ('org/name', 0.3)] (weights as given)."""
    parts = []
    for part in (p.strip() for p in spec.split(",")):
        source, sep, weight = part.rpartition(":")
        try:
            w = float(weight) if sep else math.nan
        except ValueError:
            w = math.nan
        if not source or not math.isfinite(w) or w <= 0:
            raise UserError(f"data mixture '{spec}': part '{part}' needs a positive weight after its last ':' "
                            "(data=a.jsonl:0.7,org/name:0.3; a task count too: arithmetic:600:0.5)")
        parts.append((source, w))
    return parts


def mixture_counts(sizes: list[int], weights: list[float]) -> list[int]:
    """Rows taken from each source: floor(w_i N), N = min n_i / w_i, with w normalised (no row repeats)."""
    total = sum(weights)
    w = [x / total for x in weights]
    n = min(s / x for s, x in zip(sizes, w))
    return [min(s, math.floor(x * n + 1e-9)) for s, x in zip(sizes, w)]


def mix(parts: list[list], weights: list[float], seed: int) -> list:
    """A seeded subsample of each source at the mixture's counts, interleaved in a seeded random order."""
    rng = random.Random(seed)
    out = []
    for rows, k in zip(parts, mixture_counts([len(p) for p in parts], weights)):
        out += [rows[i] for i in sorted(rng.sample(range(len(rows)), k))]
    rng.shuffle(out)
    return out
