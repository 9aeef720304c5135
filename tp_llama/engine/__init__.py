"""Running a loaded model: the step plan (plan), rank 0's scheduler and sampling, each rank's
runner, and the engine whose one step loop the CLI and the handler share (core)."""
