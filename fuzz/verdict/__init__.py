"""One case through target and oracle (runner), judged (compare, probe) into a Finding (findings)."""
