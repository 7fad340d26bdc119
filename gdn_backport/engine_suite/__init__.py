"""The real-engine suite: drive the installed vLLM on its GPU with a tiny
seeded model and prove each patchset's fix token by token.

Parent side: :func:`gdn_backport.engine_suite.suite.run_engine_suite`
(preflight, one child process per engine, scoring against a teacher-forced
reference, the report). Child side: :mod:`gdn_backport.engine_suite.driver`.
Nothing here imports torch or vLLM at import time: the modules that touch
them do so inside the functions that run in the engine process.

Exit codes (``python -m gdn_backport.engine_suite``, ``gdn-backport verify
--engine``): 0 every scenario passed; 1 a scenario failed or was
inconclusive; 2 a refusal (one line on stderr: ``gdn-backport: <path or
'vllm'>: <reason>``).
"""
