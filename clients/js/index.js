// The package entry: the module itself lives in broker/static/js/, where the broker serves it
// to browsers. Re-exporting (not copying) keeps one source for both.
export * from "../../broker/static/js/index.js";
