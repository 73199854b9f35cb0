"""Reward models scoring on the rollout side (verl's `reward.reward_model.*`, docs/verl_v1.md).

`scoring.py`: what a model reads and what its score becomes (pure); `models.py`: the discriminative
classifier replica (batched); `scorer.py`: the Rollouter's group scorer that asks the model (and the rule
reward when `use_task_rewards`), combines and counts. A judge runs on engine replicas of its own
(rollout/side_models.py); no weight sync reaches any of them. Keys and checks: config/reward_model.py.
"""
