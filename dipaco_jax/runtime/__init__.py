"""The two ways to run a recipe: the synchronous SPMD loop and the elastic pool."""
