"""Prefect flows: thin orchestration only, calling the tasks in `tasks/` (e.g. `flows.tile.tile_flow`)."""
