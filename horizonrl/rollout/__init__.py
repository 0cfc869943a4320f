"""The batched multi-turn rollout loop, prompting, records, APPO branching and rollout figures."""
