from torchspeed.cli.main import main

raise SystemExit(main())
