"""The `agent.*` config section shared by `posttrain rl env=...` and `posttrain eval env=...`."""

from __future__ import annotations

from pydantic import Field, field_validator

from posttrain.config import Config


class AgentSettings(Config):
    max_turns: int = Field(4, ge=1, description="model turns per episode (the environment answers every turn but the last)")
    max_total_tokens: int = Field(1024, ge=2, description="response tokens per episode: generated + returned (tool outputs, template glue)")
    tool_format: str = Field("auto", pattern="^(auto|template|tag)$", description="template (the chat template's <tool_call> tool calling), tag (<tool>NAME: INPUT</tool>), auto (template when the tokenizer has it)")
    tool_tags: list[str] = Field(default_factory=lambda: ["<tool>", "</tool>"], description="tag format: opening and closing tag of a call")
    max_observation_tokens: int = Field(256, ge=1, description="tool output tokens returned per turn (cut beyond)")
    max_tool_chars: int = Field(2000, ge=16, description="tool output characters (cut beyond, with a marker)")
    plan_return_len: int | None = Field(None, ge=0, description="planner: tool output tokens per observation (None: max_observation_tokens, an upper bound); the template glue is added")
    env_workers: int = Field(4, ge=1, description="threads running environment steps (tools) while the engine decodes")
    step_timeout_s: float = Field(120.0, gt=0, description="backstop for one environment step; past it the episode ends as env_timeout")

    @field_validator("tool_tags")
    @classmethod
    def _two_tags(cls, v):
        if len(v) != 2 or not all(isinstance(t, str) and t for t in v):
            raise ValueError("tool_tags must be two non-empty strings, e.g. ['<tool>', '</tool>']")
        return v
