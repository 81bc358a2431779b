from onnxkv.cli import main

raise SystemExit(main())
