from pytest_fsdp_turbo.cli import main

raise SystemExit(main())
