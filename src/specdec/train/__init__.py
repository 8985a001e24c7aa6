"""`specdec train-draft`: self-distillation data from the target, cached features, head training.

data.py     prompts from the dev files -> the target's own greedy continuations -> hidden-state shards on disk
trainer.py  the training loop (AdamW, EAGLE / Medusa losses), checkpoint + resume, head file, loss plot
"""
