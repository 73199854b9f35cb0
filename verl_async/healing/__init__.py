"""A run that heals (docs/healing.md): the trainer side restarted from its checkpoint, and what the run reports.

The engine replicas heal inside the Rollouter (rollout/healing.py); this room holds what only the
driver can do, beside pipeline.py: restart the Trainer actor and its ranks (`trainer.py`) and the
end-of-run lines about every heal (`report.py`).
"""
