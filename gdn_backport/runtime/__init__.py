"""Run-time pieces loaded inside vLLM processes (general plugin, reachability probe)."""
