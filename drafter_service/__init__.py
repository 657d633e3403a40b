"""drafter_service: see README.md and docs/architecture.md. Thin until its issue lands."""
