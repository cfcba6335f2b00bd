# Runs CMD ('|'-separated arguments), requires exit status EXPECT and, when
# REGEX is not empty, that stdout+stderr match it. Used by the tools_ tests so
# that "fails as it should" is told apart from "crashed".
string(REPLACE "|" ";" argv "${CMD}")
execute_process(COMMAND ${argv} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}${err}")
if(NOT "${rc}" STREQUAL "${EXPECT}")
  message(FATAL_ERROR "exit status ${rc}, expected ${EXPECT}")
endif()
if(NOT "${REGEX}" STREQUAL "" AND NOT "${out}${err}" MATCHES "${REGEX}")
  message(FATAL_ERROR "output does not match '${REGEX}'")
endif()
