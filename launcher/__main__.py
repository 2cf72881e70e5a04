"""`python -m launcher up`: Redis and every service of the mesh, supervised (`make serve`)."""

import sys

from launcher.mesh import main

sys.exit(main(sys.argv[1:]))
