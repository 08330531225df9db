"""omniflow.families: one folder per model family."""
