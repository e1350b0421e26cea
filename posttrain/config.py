"""Configuration: pydantic models, YAML files and `key=value` overrides (or `--key value`, `--key=value`, `--flag`).

Every recipe's config is a flat-ish pydantic model (nested models allowed, addressed with dotted
keys; on the command line the last component alone works when it names exactly one nested key,
`max_new_tokens=24` for `sampling.max_new_tokens`). Unknown keys are errors that name the nearest
valid key. `describe(cls)` renders the
`--help` text: every key with its type, default and meaning.

    cfg = parse_args(SFTConfig, ["--config", "configs/sft.yaml", "lr=1e-4", "lora.r=16"])
"""

from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError


class ConfigError(ValueError):
    """A configuration problem a user can fix; the message says what and where."""


class Config(BaseModel):
    """Base of every config: unknown keys are refused, assignments are validated."""

    # allow_inf_nan=False: `lr=.inf` or `beta=nan` is refused where it is parsed, not found by the report later
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=(), allow_inf_nan=False)


# ---------------------------------------------------------------- report_to (the sinks themselves: monitor/sinks.py)

# metric sink (posttrain/monitor/sinks.py) -> (module that must be importable, pip extra of posttrain that installs it)
SINK_REQUIREMENTS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "trackio": ("trackio", "trackio"),
    "mlflow": ("mlflow", "mlflow"),
}
REPORT_TO_HELP = ("metric sinks beside metrics.jsonl: none | tensorboard | wandb | trackio | mlflow, or a comma list "
                  "(tensorboard,wandb); each needs its extra, e.g. pip install 'posttrain[tensorboard]'")


def report_to_field() -> Any:
    """The `report_to` key of every recipe config (one default, one help text)."""
    return Field("none", description=REPORT_TO_HELP)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module set to None in sys.modules
        return False


def parse_report_to(value: Any) -> str:
    """'none' | 'a,b' | ['a', 'b'] -> canonical 'a,b' (order kept, duplicates dropped) or 'none'.
    Unknown names and missing libraries raise ValueError (pydantic turns it into a ConfigError)."""
    if value is None:
        return "none"
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    names = list(dict.fromkeys(str(x).strip().lower() for x in items if str(x).strip()))
    if not names or names == ["none"]:
        return "none"
    for name in names:
        if name == "none":
            raise ValueError("'none' cannot be combined with other sinks")
        if name not in SINK_REQUIREMENTS:
            close = difflib.get_close_matches(name, list(SINK_REQUIREMENTS), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ValueError(f"unknown sink '{name}' (choose from none, {', '.join(SINK_REQUIREMENTS)}){hint}")
        module, extra = SINK_REQUIREMENTS[name]
        if not _installed(module):
            raise ValueError(f"report_to={name} needs the '{module}' package, which is not installed: "
                             f"pip install 'posttrain[{extra}]'")
    return ",".join(names)


# the type of every `report_to` key: checked (names, installed libraries) when the config is parsed
ReportTo = Annotated[str, BeforeValidator(parse_report_to)]


MODEL_HELP = ("HF folder, built-in name (smollm2-135m-instruct, tiny-random[-qwen2|-mistral|-qwen3|-gemma2|-gemma3|-phi3|-olmo2]) "
              "or Hub id (org/name, from the HF cache or downloaded)")

# generation backends (posttrain/rollout/backends.py): the same key and meaning in every recipe that samples
BACKENDS = ("auto", "builtin", "hf", "vllm")
BACKEND_HELP = ("generation backend: auto (builtin when its engine runs the architecture, else hf; says which) | "
                "builtin (posttrain's engine) | hf (transformers generate: any model, slower) | vllm (the optional extra)")


def backend_field(default: str = "auto") -> Any:
    return Field(default, pattern="^(" + "|".join(BACKENDS) + ")$", description=BACKEND_HELP)


CHAT_TEMPLATE_HELP = ("chat template for conversational data: '' = the tokenizer's own; a built-in name (chatml, plain) "
                      "or a .jinja file; needed by base models whose tokenizer has none")


def chat_template_field() -> Any:
    return Field("", description=CHAT_TEMPLATE_HELP)


def chat_template_args_field() -> Any:
    return Field(default_factory=dict, description="variables the chat template reads, fixed for every render, "
                                                    "e.g. {enable_thinking: false} (Qwen3 without thinking)")


RESUME_HELP = ("continue from the newest checkpoint in output_dir/checkpoints (none yet: start at step 0); a key that "
               "changes the run (lr, seed, data, ...) is refused with the list of differences unless resume=force")


class CommonConfig(Config):
    """Keys every recipe shares."""

    model: str = Field("tiny-random", description=MODEL_HELP)
    data: str = Field("", description="dataset: .jsonl/.parquet file, HF datasets folder, or built-in task name")
    output_dir: str = Field("runs/run", description="run directory (config.yaml, metrics.jsonl, checkpoints/, final/, report.html)")
    max_steps: int = Field(100, ge=0, description="optimizer steps to run")
    seed: int = Field(0, description="seed for data order, initialisation and sampling")
    resume: bool | Literal["force"] = Field(False, description=RESUME_HELP)
    mixed_precision: str = Field("none", pattern="^(none|bf16)$",
                                 description="bf16: fp32 weights/grads/optimizer, backbone matmuls in bf16 via torch.autocast (lm_head stays fp32) | none")
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$",
                        description="auto (cuda if a GPU is visible, else cpu) | cpu | cuda | cuda:N")
    report_to: ReportTo = report_to_field()
    backend: str = backend_field()
    chat_template: str = chat_template_field()
    chat_template_args: dict = chat_template_args_field()
    gradient_checkpointing: bool = Field(False, description="recompute each layer's activations in backward: less memory, about one more forward of compute")


# ---------------------------------------------------------------- keys that only some runs read


def unused_key(cfg: BaseModel, applies: dict[str, tuple[Any, str]]) -> str | None:
    """A config's keys that only some runs read: `applies` maps key -> (reads(cfg) -> bool, what it applies to).
    -> the refusal of the first key set away from its default by a run that does not read it, else None: an
    option given and silently ignored makes a different run than the one asked for. At its default a key is
    accepted whatever the run (a run's own config.yaml writes every key)."""
    for key, (reads, what) in applies.items():
        if key not in cfg.model_fields_set or reads(cfg):
            continue
        if getattr(cfg, key) != type(cfg).model_fields[key].get_default(call_default_factory=True):
            return f"{key} applies to {what}, which this run is not: drop {key} (or change the run)"
    return None


# ---------------------------------------------------------------- keys, help, suggestions


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    if _is_model(annotation):
        return annotation
    for arg in get_args(annotation):  # Optional[Sub]
        if _is_model(arg):
            return arg
    return None


def all_keys(cls: type[BaseModel], prefix: str = "") -> list[str]:
    """Dotted names of every leaf key of a config class."""
    keys = []
    for name, field in cls.model_fields.items():
        sub = _nested_model(field.annotation)
        if sub is not None:
            keys.extend(all_keys(sub, f"{prefix}{name}."))
        else:
            keys.append(prefix + name)
    return keys


def _type_name(annotation: Any) -> str:
    origin = get_origin(annotation)
    if origin is None:
        return getattr(annotation, "__name__", str(annotation))
    args = ", ".join(_type_name(a) for a in get_args(annotation))
    return f"{getattr(origin, '__name__', str(origin))}[{args}]"


def describe(cls: type[BaseModel], prefix: str = "") -> str:
    """One line per key: `name (type) = default  meaning`."""
    lines = []
    for name, field in cls.model_fields.items():
        sub = _nested_model(field.annotation)
        if sub is not None:
            lines.append(describe(sub, f"{prefix}{name}."))
            continue
        default = field.get_default(call_default_factory=True)
        lines.append(f"  {prefix + name} ({_type_name(field.annotation)}) = {default!r}\n      {field.description or ''}")
    return "\n".join(lines)


# Other trainers' names (TRL, transformers TrainingArguments, PEFT) -> posttrain's key. Each entry: the keys it may be
# here, in order (the first this command has is suggested, with what differs), and what to say when it has none.
# An unknown key found here is answered "posttrain calls this X" instead of the nearest spelling
# (`gradient_accumulation_steps` is not `gradient_checkpointing`).
FOREIGN_NAMES: dict[str, tuple[tuple[tuple[str, str], ...], str]] = {
    "learning_rate": ((("optim.lr", ""),), ""),
    "gradient_accumulation_steps": ((("batch_size", "rows per optimizer step; accumulation = batch_size / micro_batch_size"),
                                     ("prompts_per_step", "prompts per optimizer step; micro_batch_tokens splits the forward passes")),
                                    "this command has no accumulation setting"),
    "per_device_train_batch_size": ((("micro_batch_size", "rows per forward/backward"),
                                     ("micro_batch_tokens", "tokens per forward/backward, not rows"),
                                     ("prompts_per_step", "prompts per step; group_size samples each")), ""),
    "train_batch_size": ((("batch_size", ""), ("prompts_per_step", "")), ""),
    "num_train_epochs": ((("epochs", ""), ("max_steps", "this command counts optimizer steps, not epochs")), ""),
    "warmup_ratio": ((("optim.warmup_ratio", ""),), ""),
    "warmup_steps": ((("optim.warmup_steps", ""),), ""),
    "lr_scheduler_type": ((("optim.schedule", "cosine | linear | constant"),), ""),
    "max_seq_length": ((("max_length", "tokens per sample"), ("sampling.max_new_tokens", "tokens per completion")), ""),
    "max_prompt_length": ((("max_length", "prompt + completion together"),), ""),
    "max_completion_length": ((("sampling.max_new_tokens", ""), ("max_length", "prompt + completion together")), ""),
    "beta": ((("beta", ""),), "this command has no beta (a KL / preference strength: posttrain dpo and rl have one)"),
    "kl_coef": ((("beta", "the KL coefficient"),), ""),
    "init_kl_coef": ((("beta", "the KL coefficient"),), ""),
    "logging_steps": ((), "posttrain logs every step (metrics.jsonl and the report_to sinks): there is no key"),
    "logging_strategy": ((), "posttrain logs every step (metrics.jsonl and the report_to sinks): there is no key"),
    "logging_dir": ((("output_dir", "metrics.jsonl and report.html are written there"),), ""),
    "save_steps": ((("save_every", ""),), ""),
    "save_strategy": ((("save_every", "every N steps; 0: only the final model"),), ""),
    "save_total_limit": ((("keep_checkpoints", ""),), ""),
    "eval_steps": ((("eval_every", ""), ("eval.every", "")), ""),
    "eval_strategy": ((("eval_every", "every N steps"), ("eval.every", "every N steps")), ""),
    "evaluation_strategy": ((("eval_every", "every N steps"), ("eval.every", "every N steps")), ""),
    "output_dir": ((("output_dir", ""), ("output", "")), ""),
    "run_name": ((("output_dir", "the run directory names the run"),), ""),
    "model_name_or_path": ((("model", ""),), ""),
    "dataset_name": ((("data", ""),), ""),
    "dataset_text_field": ((), "rows are read by their columns (messages | prompt + completion | text, docs/data.md): there is no key"),
    "num_generations": ((("group_size", ""), ("n", "samples per prompt")), ""),
    "num_iterations": ((("ppo_epochs", ""),), ""),
    "num_ppo_epochs": ((("ppo_epochs", ""),), ""),
    "num_mini_batches": ((("ppo_minibatches", ""),), ""),
    "epsilon": ((("loss_args", "the clip range goes in loss_args"),), ""),
    "cliprange": ((("loss_args", "the clip range goes in loss_args"),), ""),
    "max_grad_norm": ((("optim.max_grad_norm", ""),), ""),
    "weight_decay": ((("optim.weight_decay", ""),), ""),
    "adam_beta1": ((("optim.betas", "both at once: optim.betas=[0.9,0.999]"),), ""),
    "adam_beta2": ((("optim.betas", "both at once: optim.betas=[0.9,0.999]"),), ""),
    "adam_epsilon": ((("optim.eps", ""),), ""),
    "bf16": ((("mixed_precision", "mixed_precision=bf16"),), ""),
    "fp16": ((("mixed_precision", "bf16 only: mixed_precision=bf16"),), ""),
    "torch_dtype": ((("dtype", ""),), ""),
    "use_peft": ((("lora.enabled", ""),), ""),
    "lora_r": ((("lora.r", ""),), ""),
    "lora_alpha": ((("lora.alpha", ""),), ""),
    "lora_dropout": ((("lora.dropout", ""),), ""),
    "lora_target_modules": ((("lora.target_modules", ""),), ""),
    "resume_from_checkpoint": ((("resume", "resume=true continues from the newest checkpoint in output_dir"),), ""),
    "data_seed": ((("seed", ""),), ""),
    "loss_type": ((("loss", ""),), ""),
    "center_rewards_coefficient": ((("center_coef", ""),), ""),
    "use_vllm": ((("backend", "backend=vllm"),), ""),
    "assistant_only_loss": ((), "posttrain sft always trains on the assistant / completion tokens only: there is no key"),
    "completion_only_loss": ((), "posttrain sft always trains on the assistant / completion tokens only: there is no key"),
}


def _key_here(target: str, keys: list[str]) -> str | None:
    """The full key `target` names in this config (itself, a section, or the tail of exactly one key: `optim.lr` is
    `train.optim.lr` in rs), else None."""
    if target in keys or any(k.startswith(target + ".") for k in keys):
        return target
    tails = [k for k in keys if k.endswith("." + target)]
    return tails[0] if len(tails) == 1 else None


def _foreign_hint(key: str, keys: list[str]) -> str | None:
    """'; posttrain calls this 'X' (...)' for another trainer's name (FOREIGN_NAMES), else None."""
    name = key if key in FOREIGN_NAMES else key.rsplit(".", 1)[-1]
    if name not in FOREIGN_NAMES:
        return None
    candidates, otherwise = FOREIGN_NAMES[name]
    for target, note in candidates:
        here = _key_here(target, keys)
        if here is not None and here != key:
            detail = f"{note}; " if note else ""
            return f"; posttrain calls this '{here}' ({detail}{name} is the TRL/transformers name)"
    return f"; {otherwise}" if otherwise else None


def _suggest(key: str, keys: list[str]) -> str:
    foreign = _foreign_hint(key, keys)
    if foreign is not None:
        return foreign
    tail = key.rsplit(".", 1)[-1]
    exact = [k for k in keys if k.rsplit(".", 1)[-1] == tail]  # `lr` given for `optim.lr`
    close = exact or difflib.get_close_matches(key, keys, n=1, cutoff=0.5)
    if not close:  # try the last component alone: `lr` for `optim.lr`
        tails = {k.rsplit(".", 1)[-1]: k for k in keys}
        hit = difflib.get_close_matches(key.rsplit(".", 1)[-1], list(tails), n=1, cutoff=0.6)
        close = [tails[hit[0]]] if hit else []
    return f"; did you mean '{close[0]}'?" if close else ""


def _check_keys(cls: type[BaseModel], data: dict, source: str, prefix: str = "") -> None:
    keys = all_keys(cls)
    for name, value in data.items():
        if not isinstance(name, str):  # YAML reads `1:`, `true:` or `2024-01-01:` as a number, bool or date
            where = f"under '{prefix[:-1]}'" if prefix else "at the top level"
            raise ConfigError(f"{source}: key {name!r} {where} was read by YAML as {_a(type(name).__name__)}, not a "
                              f"key name: keys are names such as "
                              f"{', '.join(keys[:3])} (--help lists them)")
        field = cls.model_fields.get(name)
        if field is None:
            raise ConfigError(f"{source}: unknown key '{prefix + name}'{_suggest(prefix + name, keys)}")
        sub = _nested_model(field.annotation)
        if sub is not None and isinstance(value, dict):
            _check_keys(sub, value, source, f"{prefix}{name}.")


def _set_dotted(data: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override '{key}': '{p}' is not a section")
    node[parts[-1]] = value


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _parse_value(text: str) -> Any:
    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text


# ---------------------------------------------------------------- loading


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = getattr(e, "problem", None) or " ".join(str(e).split())
        raise ConfigError(f"{path}: invalid YAML{where}: {what}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of keys to values")
    return data


def build(cls: type[BaseModel], data: dict, source: str = "config") -> Any:
    """Validate a dict into `cls`, turning pydantic errors into one readable ConfigError."""
    _check_keys(cls, data, source)
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        msgs = []
        for err in e.errors():
            loc = ".".join(str(x) for x in err["loc"])
            got = err.get("input")
            msg = err["msg"].removeprefix("Value error, ")
            if not loc or isinstance(got, dict):  # a check across keys (model_validator): its message names them
                msgs.append(f"{source}: {_name_the_key(msg, data)}")
            else:
                msgs.append(f"{source}: {loc}: {msg} (got {got!r}){_quote_hint(err, loc)}")
        raise ConfigError("; ".join(msgs)) from None


def _leaves(data: dict, prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for k, v in data.items():
        out.extend(_leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else [(f"{prefix}{k}", v)])
    return out


def _name_the_key(msg: str, data: dict) -> str:
    """A check across keys that quotes a value but not its key ("unknown distillation loss 'kl'") gets the key
    in front ("divergence=kl: ..."), when exactly one given key holds that value."""
    hits = [(k, v) for k, v in _leaves(data) if isinstance(v, str) and v and f"'{v}'" in msg]
    if len(hits) != 1 or hits[0][0].rsplit(".", 1)[-1] in msg:
        return msg
    key, value = hits[0]
    return f"{key}={value}: {msg}"


def _a(noun: str) -> str:
    return ("an " if noun[:1] in "aeiou" else "a ") + noun


def _quote_hint(err: dict, loc: str) -> str:
    """'; quote it ...' when a text key got a number, bool, date or mapping because YAML read it so."""
    got = err.get("input")
    if err.get("type") != "string_type" or isinstance(got, (str, list)) or got is None:
        return ""
    shown = "{...}" if isinstance(got, dict) else got
    return (f"; YAML read the value as {_a(type(got).__name__)}: quote it to keep the text "
            f"({loc}: '{shown}' in a YAML file)")


def _field(cls: type[BaseModel], key: str) -> Any:
    """The pydantic field of dotted `key` in `cls` (None: not a leaf key)."""
    model: Any = cls
    parts = key.split(".")
    for part in parts[:-1]:
        field = model.model_fields.get(part) if model is not None else None
        model = _nested_model(field.annotation) if field is not None else None
    return model.model_fields.get(parts[-1]) if model is not None else None


def _is_text(cls: type[BaseModel], key: str) -> bool:
    """Whether `key` is a plain text field (str, or str | None): its command-line value is kept as written."""
    field = _field(cls, key)
    if field is None:
        return False
    tp = field.annotation
    return tp is str or (get_origin(tp) is not None and set(get_args(tp)) == {str, type(None)})


def _text_value(text: str, optional: bool) -> Any:
    """A str key's `key=value` text as the user meant it: `output_dir=2024` stays '2024' and `system_prompt=Be
    brief: x` stays text (YAML would read a number and a mapping); a YAML-quoted value loses its quotes; `null`
    is None where the key allows it."""
    stripped = text.strip()
    if len(stripped) >= 2 and stripped[0] == stripped[-1] and stripped[0] in "'\"":
        parsed = _parse_value(stripped)
        if isinstance(parsed, str):
            return parsed
    if optional and stripped in ("null", "~", "None"):
        return None
    return text


def _resolve_key(key: str, keys: list[str]) -> str:
    """A full dotted key, a section prefix, or the last component of exactly one nested key
    (`max_new_tokens=24` for `sampling.max_new_tokens`); anything else is refused with a suggestion."""
    if key in keys or any(k.startswith(key + ".") for k in keys):
        return key
    tails = [k for k in keys if "." in k and k.rsplit(".", 1)[-1] == key]
    if len(tails) == 1:
        return tails[0]
    if len(tails) > 1:
        raise ConfigError(f"key '{key}' is ambiguous: write one of {', '.join(tails)}")
    raise ConfigError(f"unknown key '{key}'{_suggest(key, keys)}")


def split_flags(argv: list[str], flags: tuple[str, ...]) -> tuple[list[str], set[str]]:
    """Pull boolean switches such as `--json` out of argv: (rest, switches found)."""
    return [a for a in argv if a not in flags], {a for a in argv if a in flags}


BOOL_WORDS = ("true", "false", "yes", "no", "on", "off", "1", "0")


def _is_bool(cls: type[BaseModel], key: str) -> bool:
    """Whether the dotted `key` of `cls` is a bool (or an optional bool) field."""
    field = _field(cls, key)
    return field is not None and (field.annotation is bool or bool in get_args(field.annotation))


def _dashed(arg: str, nxt: str | None, cls: type[BaseModel], keys: list[str]) -> tuple[str, bool]:
    """`--key=value`, `--key value`, `--flag` / `--no-flag` (bool keys) -> ("key=value", whether `nxt` was used).
    Hyphens in the name read as underscores (`--max-steps`); an unknown key is refused with its hint here."""
    name, eq, value = arg[2:].partition("=")
    name = name.replace("-", "_")
    if not eq and name.startswith("no_") and _key_here(name, keys) is None:
        key = _key_here(name[3:], keys)
        if key is not None and _is_bool(cls, key):
            return f"{key}=false", False
    key = _resolve_key(name, keys)
    if eq:
        return f"{name}={value}", False
    if _is_bool(cls, key):
        if nxt is not None and nxt.lower() in BOOL_WORDS:
            return f"{name}={nxt}", True
        return f"{name}=true", False
    if nxt is None or nxt.startswith("--"):
        raise ConfigError(f"--{name} needs a value: --{name} VALUE, --{name}=VALUE or {name}=VALUE")
    return f"{name}={nxt}", True


def split_args(cls: type[BaseModel], argv: list[str]) -> tuple[list[str], list[str]]:
    """argv in the forms every trainer takes -> (`key=value`, `--config FILE` and `-h`/`--help` items in order,
    the positional words left over). Accepted: `key=value`, `--key value`, `--key=value`, `--flag` (a bool key:
    true; `--flag false` and `--no-flag` too), `--config FILE` / `--config=FILE`."""
    keys = all_keys(cls)
    out, positional = [], []
    i = 0
    while i < len(argv):
        arg, nxt = argv[i], argv[i + 1] if i + 1 < len(argv) else None
        i += 1
        if arg in ("-h", "--help") or arg.startswith("--config="):
            out.append(arg)
        elif arg == "--config":
            if nxt is None:
                raise ConfigError("--config needs a file name")
            out.append(f"--config={nxt}")
            i += 1
        elif arg.startswith("--") and len(arg) > 2:
            item, used = _dashed(arg, nxt, cls, keys)
            out.append(item)
            i += used
        elif "=" in arg and not arg.startswith("-"):
            out.append(arg)
        else:
            positional.append(arg)
    return out, positional


USAGE_FORMS = "[--config FILE.yaml] [key=value | --key value | --key=value | --flag ...]"


def parse_args(cls: type[BaseModel], argv: list[str], prog: str = "posttrain") -> Any:
    """`[--config FILE] key=value | --key value ...` -> validated config. `--help` prints every key and exits."""
    data: dict = {}
    overrides: list[tuple[str, Any]] = []
    if "-h" in argv or "--help" in argv:
        argv = ["--help"]  # before any key is checked
    items, positional = split_args(cls, argv)
    if positional:
        raise ConfigError(f"unexpected argument '{positional[0]}': use key=value, --key value, --config FILE or --help")
    for arg in items:
        if arg in ("-h", "--help"):
            print(f"usage: {prog} {USAGE_FORMS}\n")
            print((cls.__doc__ or "").strip() + "\n\nkeys:")
            print(describe(cls))
            raise SystemExit(0)
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
            loaded = load_yaml(path)
            _check_keys(cls, loaded, str(path))
            data = _deep_merge(data, loaded)
        else:  # key=value (split_args wrote every other form this way); the value is parsed once its key is known
            key, value = arg.split("=", 1)
            overrides.append((key.strip(), value))
    keys = all_keys(cls)
    for key, text in overrides:
        full = _resolve_key(key, keys)
        if _is_text(cls, full):
            value = _text_value(text, optional=_field(cls, full).annotation is not str)
        else:
            value = _parse_value(text)
        _set_dotted(data, full, value)
    return build(cls, data)


def save_yaml(cfg: BaseModel, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
