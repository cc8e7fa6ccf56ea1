"""The evaluate stage: frozen-feature probes on the lab's annotations (tile labels: `labels`)."""
