from torchkv.cli import main

main()
