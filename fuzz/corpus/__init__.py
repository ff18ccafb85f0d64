"""The corpus on disk (store), replaying it (replay), shrinking findings into it (minimize) and
replaying one case across releases (bisect)."""
