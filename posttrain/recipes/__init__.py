"""The commands (layer 10, above `training`; only `cli` sits higher): sft, rm (and `rm probe`), dpo, rs,
rl (`rl/`), distill (`distill/`) and quickstart, each a module that reads top to bottom, plus what
several of them share (`reference_cache`, `length_probe`).
"""
