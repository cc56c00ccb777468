"""The dashboard (`shipyard dashboard --runs DIR`): training curves, trajectories, evals, tasks and the sandbox fleet
in a browser. `app` serves it; `runs` reads run directories by name, incrementally; `static/` is the page itself
(plain JavaScript and SVG: no build step, no network)."""
