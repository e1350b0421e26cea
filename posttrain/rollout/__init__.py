"""Generation (layer 5, beside `rewards`): the built-in engine (`engine`, `scheduler`, `kv`, `runner`,
`sequence`), its typed API (`types`, `settings`), the HF and vLLM backends behind the same API, the
trajectories between the phases of an RL step (`trajectory`), `posttrain generate` (`cli`) and
`posttrain serve` (`serve`).
"""
