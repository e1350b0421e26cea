"""Evaluation (layer 7, above `agentic` and `plan`): pass@k / cons@k / pass^k with intervals (`metrics`,
`stats`, `results`), the runner and its protocol (`runner`, `prompts`, `protocol`), paired comparison
(`compare`), contamination, judge labelling and win rates (`contamination`, `label`, `winrate`), evaluation
during training (`hook`), agentic episodes (`agentic`), reports and `posttrain eval` (`report`, `cli`).
"""
