from meshd_mps.serving.cli import main

raise SystemExit(main())
