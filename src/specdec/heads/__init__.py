"""Trained draft heads that read the target's hidden states: an EAGLE-style feature drafter and Medusa heads.

config.py  the head's configuration, the target fingerprint and the head file (safetensors + JSON sidecar)
modules.py the torch modules (training and inference share them) and the frozen target parts they use
"""
