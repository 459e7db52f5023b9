export * from "../../broker/static/js/index.js";
