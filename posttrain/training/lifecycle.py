"""The run lifecycle every training recipe shares: run directory, resume, checkpoints, final model,
summary and report. A recipe reads:

    life = RunLifecycle(cfg)                         # output_dir, config.yaml; finds the checkpoint to resume
    ... build model, optimizer, scheduler ...
    state = life.restore(model, optimizer, scheduler) # {} on a fresh run; life.start = first step to run
    metrics = life.metrics()                          # metrics.jsonl (trimmed to the checkpoint on resume) + report_to sinks
    for step in range(life.start, cfg.max_steps):
        ...
        life.checkpoint(step + 1, model, optimizer, scheduler, state_dict, tok=tok)   # honours save_every
    life.save_final(model, tok, lora=False)
    life.finish(summary, title, sections)             # summary.json + report.html; closes the sinks

Under torchrun (`dist_info` with world size W > 1) every rank runs the recipe: rank 0 alone writes the
run directory's files, every rank takes part in the collective parts (sharded checkpoints, final weights).
"""

from __future__ import annotations

import json
from pathlib import Path

from posttrain.models.forward import unwrap
from posttrain.monitor.metrics import MetricsWriter
from posttrain.monitor.report import write_report
from posttrain.monitor.sinks import open_sinks
from posttrain.outputs import check_output_dir, write_json
from posttrain.systems.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from posttrain.systems.dist import DistInfo, barrier
from posttrain.systems.fsdp import save_full
from posttrain.training import resume
from posttrain.training.run import setup_run


class RunLifecycle:
    def __init__(self, cfg, dist_info=None, checkpoints: bool = True):
        self.cfg = cfg
        self.info = dist_info or DistInfo()
        out = check_output_dir(cfg.output_dir)
        existing = list_checkpoints(out) if cfg.resume else []
        self.resume_from = existing[-1] if existing else None
        # the resume contract (training/resume.py): refused here, before config.yaml or anything else is written
        notes = resume.check(cfg, self.resume_from, out) if self.resume_from is not None else []
        if cfg.resume and self.resume_from is None and checkpoints:
            notes = [f"resume: no checkpoint in {out / 'checkpoints'} yet: starting from step 0"]
        self.record = {"data_sha256": resume.data_digest(getattr(cfg, "data", ""))}  # kept in every checkpoint
        self.out = setup_run(cfg, resume=cfg.resume, write=self.info.main)
        for note in notes if self.info.main else []:
            print(note, flush=True)
        barrier(self.info)
        self.start = 0
        self.restored: dict = {}  # the state of the checkpoint `restore` loaded ({} on a fresh run)
        self.writer: MetricsWriter | None = None

    @property
    def main(self) -> bool:
        return self.info.main

    @property
    def sharded(self) -> bool:
        return self.info.world > 1

    @property
    def resuming(self) -> bool:
        return self.resume_from is not None

    def restore(self, model, optimizer, scheduler, extras: dict | None = None) -> dict:
        """Load the newest checkpoint in place (weights, optimizer, scheduler, RNG, `extras`: name ->
        (module, optimizer)); returns its state."""
        if self.resume_from is None:
            return {}
        resume.check_steps(self.cfg, resume.checkpoint_step(self.resume_from), self.resume_from)  # epochs= resolved now
        state = load_checkpoint(self.resume_from, model, optimizer, scheduler, extras)
        self.start, self.restored = state["step"], state
        return state

    def metrics(self) -> MetricsWriter:
        return self.metrics_from(self.start if self.resuming else None)

    def metrics_from(self, resume_step: int | None) -> MetricsWriter:
        """metrics.jsonl kept up to `resume_step` (None: emptied), and the sinks of `report_to` opened."""
        if not self.main:
            self.writer = MetricsWriter(None)
            return self.writer
        sinks = open_sinks(getattr(self.cfg, "report_to", "none"), self.out, self.cfg.model_dump(mode="json"), resume_step)
        self.writer = MetricsWriter(self.out / "metrics.jsonl", resume_step=resume_step, sinks=sinks)
        return self.writer

    def fresh_file(self, name: str) -> Path:
        """A run-directory JSON-lines file that a fresh run empties and a resumed run appends to, once the
        lines of steps after the checkpoint (written before the run was cut) are dropped (call after `restore`)."""
        path = self.out / name
        if not self.main:
            return path
        if not self.resuming:
            path.write_text("")
        elif path.is_file():
            lines = path.read_text().splitlines(keepends=True)
            kept = [line for line in lines if _step_of(line) <= self.start]
            if len(kept) < len(lines):
                path.write_text("".join(kept))
        return path

    def checkpoint(self, done: int, model, optimizer, scheduler, state: dict, force: bool = False,
                   extras: dict | None = None, tok=None) -> None:
        """Save at every `save_every` steps, and always when `force` (the end of the run). With the tokenizer
        `tok`, checkpoints/step-N/ is also a model folder (`from_pretrained`; a PEFT adapter under LoRA)."""
        every = self.cfg.save_every
        if force or (every and done % every == 0 and done != self.cfg.max_steps):
            state = {**state, "run": {"config": self.cfg.model_dump(mode="json"), **self.record}}  # what resume compares
            save_checkpoint(self.out, done, model, optimizer, scheduler, state, keep=self.cfg.keep_checkpoints,
                            extras=extras, dist_info=self.info if self.sharded else None, tok=tok)

    def save_final(self, model, tok, lora: bool = False) -> Path:
        """final/ loads with AutoModelForCausalLM.from_pretrained; LoRA runs also keep final/adapter/.
        A sharded model is gathered (every rank) and written by rank 0."""
        path = self.out / "final"
        if self.sharded:
            save_full(model, tok, path, self.info)
            barrier(self.info)
            return path
        path.mkdir(parents=True, exist_ok=True)
        if lora:
            model.save_pretrained(path / "adapter")
            tok.save_pretrained(path / "adapter")
            model = model.merge_and_unload()

        unwrap(model).save_pretrained(path)
        tok.save_pretrained(path)
        return path

    def history(self) -> list[dict]:
        path = self.out / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def finish(self, summary: dict, title: str, sections: dict) -> None:
        if not self.main:
            return
        write_json(self.out / "summary.json", summary, default=str)
        write_report(self.out, title, {**sections, "config": self.cfg.model_dump(mode="json")})
        if self.writer is not None:
            self.writer.close()


def _step_of(line: str) -> int:
    """The `step` of a JSON-lines record (0: none, or not a JSON object)."""
    try:
        record = json.loads(line)
    except ValueError:
        return 0
    return record.get("step", 0) if isinstance(record, dict) else 0
