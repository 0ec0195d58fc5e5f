from services.tokenizer.service import main

main()
