"""meshserve's benchmark kit: one script per question, its current result in bench/results/ (bench/README.md)."""
