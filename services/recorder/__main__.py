from services.recorder.service import main

main()
