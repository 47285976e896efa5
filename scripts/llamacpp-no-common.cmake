# Read by CMake after each project() of the llama-cpp-python build (scripts/install-llamacpp.sh
# passes it as CMAKE_PROJECT_INCLUDE).  In llama.cpp's own project it turns off llama.cpp's
# `common` library (argument parsing, chat templates, JSON schemas: a quarter of the C++ to
# compile), which llama-cpp-python enables for its multimodal library only; specdec does not build
# that library, and libllama / libggml do not use `common`.  A normal variable in llama.cpp's
# directory scope wins over the cache entry llama-cpp-python forces on (option() leaves an existing
# normal variable alone, policy CMP0077).
if(PROJECT_NAME STREQUAL "llama.cpp")
    set(LLAMA_BUILD_COMMON OFF)
    message(STATUS "specdec: llama.cpp's common library is not built")
endif()
