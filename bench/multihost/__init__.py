"""The multi-host benches: emulated hosts (network namespaces) with capped links."""
