"""pr51565's codemods (strategy ``reclassify``), one per module, in the order the plan runs them.

- :mod:`.builder_rule`: rows without prior state are prefills (the builders);
- :mod:`.v1_guard`: no FULL decode CUDA graph for a batch with a new row (V1 runner);
- :mod:`.v2_guard`: no uniform token count for a step with a new request (V2 runner);
- :mod:`.base`: what they share; :mod:`.examples`: their examples.

A builder fix is whole only with every FULL decode route of the tree's
runners guarded: the plan runs all three over the tree and proves the
result by analysing the tree again.
"""
