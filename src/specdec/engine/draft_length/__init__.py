"""The draft-length policy: how many tokens each speculating sequence drafts in a step.

  policy.py         the interface the engine calls (`DraftLengthPolicy`, `StepCost`) and the fixed policy
                    (`BatchDraftPolicy`)
  adaptive.py       the adaptive policy: per-request acceptance estimates and a cost model -> k per step
                    (`AdaptiveDraftPolicy`, `build_draft_policy`)
  costs.py          pure cost arithmetic: T(n), E(k), the knee, the step's expected tokens per second
                    (`CostModel`, `CostCalibration`)
  measure.py        timing the forwards within a budget (`profile_costs`, `measure_cost_profile`)
  profile_store.py  the measured profiles on disk, keyed by model, weight format, threads, machine and kernels
                    (`ProfileKey`, `load_or_measure`), refined from the engine's timed steps (`ProfileLearner`)

See docs/draft-length.md.
"""
