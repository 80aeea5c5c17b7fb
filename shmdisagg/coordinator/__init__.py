"""The coordinator: single writer of the shared table, executor health, fleet supervision."""
