"""One module per scenario; each exposes run(ctx) -> list[Row]."""
