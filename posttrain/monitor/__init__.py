"""What a run reports (layer 4, beside `models` and `judge`): metrics.jsonl and its sinks (`metrics`, `sinks`),
RL and preference health alarms (`alarms`, `preference_alarms`), the training dashboard (`dashboard`) and
report pages (`report`, `quickstart_report`, `posttrain report` in `report_cli`).
"""
