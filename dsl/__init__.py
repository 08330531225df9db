"""The `.omni` language: grammar, AST and parser (installed as `omniflow.dsl`)."""
