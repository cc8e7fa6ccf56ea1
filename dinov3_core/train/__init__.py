"""Training building blocks: schedules and optimizer parameter groups."""
